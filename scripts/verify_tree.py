"""Run a pytest selection against a tree (this checkout, a directory or a packed archive).

    python scripts/verify_tree.py --tree tree.tar.gz -m cuda --repeats 3
    python scripts/verify_tree.py --id tests/core/test_hold.py::test_x --no-isolate -- -x

Prints the per-id table (r1…rN, alone, stable), the failures and pytest's summary lines.
Exit code: 0 when some selected test ran and every one passed (or skipped) in every repeat;
1 otherwise, "no tests ran" included (every test skipped or deselected, e.g. -m cuda on a CPU);
2 when the tree is unusable (missing, corrupted archive, manifest mismatch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# Run from a tree that is not installed (an uploaded tree): import its own replaykit.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replaykit import tables
from replaykit.workflow.verify import resolve_tree, run_selection


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="", help="directory or .tar.gz/.tgz/.tar (default: this checkout)")
    ap.add_argument("-m", "--markers", default="cuda", help="pytest -m expression; '' for none (default: cuda)")
    ap.add_argument("--id", action="append", dest="ids", default=[], metavar="NODE_ID",
                    help="a test id to select (repeatable)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the whole selection")
    ap.add_argument("--no-isolate", action="store_true", help="do not rerun each failing id alone")
    ap.add_argument("--out", type=Path, help="folder for junit XML, logs and an extracted archive "
                    "(default: a new temporary folder)")
    ap.add_argument("--timeout", type=float, help="seconds before one pytest run is killed")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("extra", nargs="*", help="more pytest arguments, after --")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="replaykit-verify-"))
    try:
        tree = resolve_tree(args.tree, out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tree: {tree}\nout: {out}")
    selection = run_selection(
        tree,
        markers=args.markers or None,
        ids=args.ids,
        repeats=args.repeats,
        isolate_failures=not args.no_isolate,
        extra_args=args.extra,
        out_dir=out,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    table = selection.table()
    print(tables.text(table.to_dict("records"), list(table.columns)))
    failures = selection.failures()
    if len(failures):
        print("\nfailures:")
        print(tables.text(failures.to_dict("records"), list(failures.columns)))
    print()
    print("\n".join(selection.summary_lines()))
    for line in selection.run_errors():
        print(f"run error: {line}")
    print(f"outcome: {selection.outcome_line()}")
    return 0 if selection.ok else 1


if __name__ == "__main__":
    sys.exit(main())
