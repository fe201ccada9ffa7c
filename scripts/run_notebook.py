"""Run one notebook through papermill into runs/<time>_<device>_torch<ver>_<tree>/.

    python scripts/run_notebook.py notebooks/parity.ipynb -p steps 3 -y '{tasks: [detect]}'

Prints the run folder and a one-line summary. Exit code: 0 passed, 1 failed (a cell
raised or timed out), 2 error (kernel died, runner error, bad arguments).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a tree that is not installed (an uploaded tree): import its own replaykit.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replaykit.workflow.runs import cli_parameters, run_notebook, summary_line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                    help="parameter, converted like papermill -p (int, float, True/False/None, str)")
    ap.add_argument("-r", "--raw", nargs=2, action="append", metavar=("NAME", "VALUE"),
                    help="parameter kept as a string")
    ap.add_argument("-y", "--yaml", action="append", metavar="YAML_OR_JSON",
                    help="parameters as YAML/JSON text or a file holding it (lists, dicts)")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument("--kernel", help="kernelspec name (default: register this interpreter)")
    ap.add_argument("--cell-timeout", type=int, help="seconds before a cell is interrupted")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--tree", type=Path, help="tree whose commit the fingerprint records")
    ap.add_argument("--cwd", type=Path, help="kernel working directory (default: here)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = cli_parameters(args.parameter, args.raw, args.yaml)
        result = run_notebook(
            args.notebook,
            params,
            runs_dir=args.runs_dir,
            kernel_name=args.kernel,
            cell_timeout=args.cell_timeout,
            progress=not args.no_progress,
            tree=args.tree,
            cwd=args.cwd,
        )
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.run_dir)
    print(summary_line(result.summary))
    return {"passed": 0, "failed": 1}.get(result.summary["status"], 2)


if __name__ == "__main__":
    sys.exit(main())
