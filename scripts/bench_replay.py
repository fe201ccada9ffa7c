#!/usr/bin/env python3
"""Benchmark eager vs make_graphed_callables vs replaykit; writes a Markdown table and JSON.

python scripts/bench_replay.py [--steps 60] [--rounds 6] [--out runs/bench] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replaykit.testing import bench
from replaykit.verify.determinism import enable_determinism
from replaykit.workflow.fingerprint import fingerprint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=60, help="batches per arm (first 5 are warm-up)")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--out", type=Path, default=None, help="folder for bench.md and bench.json")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run on a CPU")
    args = ap.parse_args(argv)
    enable_determinism()  # every arm is compared with eager bit for bit
    sizes = bench.SIZES
    if args.quick:
        sizes = (bench.Size("tiny", 2, 8, 4, 2),)
    results = bench.run(
        sizes,
        args.device,
        steps=args.steps,
        rounds=args.rounds,
        progress=lambda r: print(
            f"  {r.size:>13} {r.arm:>23} {r.median_ms:8.3f} ms  equal={r.equals_eager}", flush=True
        ),
    )
    rows = bench.table(results)
    md = bench.markdown(rows)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.md").write_text(md + "\n")
        payload = {
            "fingerprint": fingerprint(),
            "rows": rows,
            "step_ms": {f"{r.size}/{r.arm}": r.step_ms for r in results},
        }
        (args.out / "bench.json").write_text(json.dumps(payload, indent=1, default=str))
        print(f"wrote {args.out}/bench.md and bench.json")
    return 0 if all(r.equals_eager for r in results if r.arm == "replaykit") else 1


if __name__ == "__main__":
    raise SystemExit(main())
