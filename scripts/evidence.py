"""Print the evidence of notebook runs as Markdown, ready to paste into an engineering log.

    python scripts/evidence.py                                   # every run under runs/
    python scripts/evidence.py --batch runs/batch_<UTC>_cuda/index.json --out log-entry.md
    python scripts/evidence.py runs/20261129T0801Z_cpu_torch2.13.0_3b8d7c2

Prints ``| Tree | Runtime | Result |``, the failures per test id, links to the executed
notebooks (relative to --out's folder, else to the current one) and warnings. Every
executed notebook is checked against the sha256 in its summary.json. Exit code: 0 ok,
1 a notebook was edited after its run (or is missing), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a tree that is not installed (an uploaded tree): import its own replaykit.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replaykit.workflow.evidence import collect


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", type=Path, help="run folders (summary.json + notebook)")
    ap.add_argument("--runs", action="append", type=Path, default=[],
                    help="a folder of runs, batch folders included (default: runs/ when nothing is given)")
    ap.add_argument("--batch", action="append", type=Path, default=[],
                    help="a batch (or bisect/arms) index.json or its folder")
    ap.add_argument("--out", type=Path, help="also write the Markdown to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs = args.runs or ([] if args.batch or args.folders else [Path("runs")])
    try:
        ev = collect(runs=runs, batches=args.batch, folders=args.folders)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ev.runs:
        skipped = f" ({len(ev.skipped)} folder(s) without a notebook summary)" if ev.skipped else ""
        print(f"error: no notebook runs found{skipped}", file=sys.stderr)
        return 2
    text = ev.markdown(relative_to=args.out.parent if args.out else None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    if ev.skipped:
        print(f"skipped {len(ev.skipped)} folder(s) without a notebook summary", file=sys.stderr)
    if ev.edited:
        print(f"{len(ev.edited)} notebook(s) edited after the run or missing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
