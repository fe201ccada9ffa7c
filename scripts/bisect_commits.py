"""Find the first commit that fails a test selection; or run it on several trees side by side.

    python scripts/bisect_commits.py --good 3cf592d --bad bb3c0b8 -m cuda
    python scripts/bisect_commits.py --good v1 --bad HEAD -m "" --id tests/core/test_hold.py -- -x
    python scripts/bisect_commits.py --arm baseline=main --arm candidate=HEAD --arm diagnostic=../diag -m cuda

Each commit is packed and run through this checkout's notebooks/verify.ipynb; runs and an
index.json go to runs/bisect_<UTC>_… (or runs/arms_<UTC>_…). A commit whose run errs (kernel
died, collection error) is skipped, as with `git bisect skip`. Exit code: bisect 0 when the
first bad commit is known, 1 when skipped commits leave it open; arms 0; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a tree that is not installed (an uploaded tree): import its own replaykit.
# (Not named bisect.py: scripts/ comes first on sys.path, and the standard library's bisect,
# which torch imports, would be shadowed for every script here.)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replaykit.workflow.bisect import arms, bisect


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--good", help="a revision where the selection passes")
    ap.add_argument("--bad", help="a later revision where it fails")
    ap.add_argument("--arm", action="append", default=[], metavar="LABEL=TREE",
                    help="instead of bisecting: run on this tree (revision, folder or archive); repeatable")
    ap.add_argument("-m", "--markers", default="cuda", help="pytest -m expression; '' for none (default: cuda)")
    ap.add_argument("--id", action="append", dest="ids", default=[], metavar="NODE_ID", help="a test id (repeatable)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the selection per tree")
    ap.add_argument("--timeout", type=float, default=0, help="seconds before one pytest run is killed")
    ap.add_argument("--repo", type=Path, default=Path("."), help="repository (default: here)")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument("--kernel", help="kernelspec name (default: this interpreter)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("extra", nargs="*", help="more pytest arguments, after --")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common = {"markers": args.markers or None, "ids": args.ids, "runs_dir": args.runs_dir,
              "kernel": args.kernel, "progress": not args.no_progress, "repeats": args.repeats,
              "extra_args": args.extra, "run_timeout": args.timeout}
    try:
        if args.arm:
            if args.good or args.bad:
                raise ValueError("give --arm, or --good and --bad, not both")
            trees = {}
            for item in args.arm:
                label, sep, tree = item.partition("=")
                if not sep or not label or not tree:
                    raise ValueError(f"--arm {item!r}: expected LABEL=TREE")
                if label in trees:
                    raise ValueError(f"--arm label {label!r} given twice")
                trees[label] = tree
            result = arms(trees, repo=args.repo, **common)
            print(result.folder)
            print(result.markdown())
            return 0
        if not (args.good and args.bad):
            raise ValueError("give --good and --bad (or --arm LABEL=TREE ...)")
        found = bisect(args.repo, args.good, args.bad, **common)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(found.folder)
    print(found.report(), end="")
    return 0 if found.first_bad is not None else 1


if __name__ == "__main__":
    sys.exit(main())
