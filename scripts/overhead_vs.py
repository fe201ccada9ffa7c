#!/usr/bin/env python3
"""replaykit's host time per replayed call, this tree against another commit, side by side.

    python scripts/overhead_vs.py [--base 2b40927] [--rounds 7] [--calls 1000] [--zero-in-place]

Checks the base commit out into a temporary worktree, then alternates one round of
``python -m replaykit.testing.bench.overhead`` in each tree (this one first, then the base, and
so on): the machine's load falls on both alike. Prints each tree's median per key and the ratio
(this tree / base). The null backend replays nothing, so this is replaykit's Python alone.
``--zero-in-place`` times loops that zero ``.grad`` in place (``zero_grad(set_to_none=False)``);
the base then runs this tree's bench module, which has that loop."""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("bare Function us", "replaykit us", "added us", "added vs C entry us", "guards us")


def _round(tree: Path, calls: int, in_place: bool) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "replaykit.testing.bench.overhead",
            "--rounds=1",
            f"--calls={calls}",
            *(["--zero-in-place"] if in_place else []),
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    ).stdout
    found = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in KEYS:
            found[key.strip()] = float(value)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="2b40927")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--zero-in-place", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        if args.zero_in_place:
            bench = "replaykit/testing/bench/overhead.py"
            shutil.copyfile(ROOT / bench, base / bench)
        try:
            runs: dict[str, list[dict[str, float]]] = {"this": [], "base": []}
            for i in range(args.rounds):
                runs["this"].append(_round(ROOT, args.calls, args.zero_in_place))
                runs["base"].append(_round(base, args.calls, args.zero_in_place))
                print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"| per replayed call (median of {args.rounds}) | {head} | {args.base} | ratio |")
    print("|---|---|---|---|")
    for key in KEYS:
        this = statistics.median(r[key] for r in runs["this"] if key in r)
        was = statistics.median(r[key] for r in runs["base"] if key in r)
        print(f"| {key} | {this:.1f} | {was:.1f} | {this / was:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
