#!/usr/bin/env python3
"""Run the Lightning parity matrix (native vs replay, plus unsafe arms) and save the result table.

    python scripts/parity_matrix.py --device cuda --out runs/<folder> [--quick] [--no-unsafe]

Writes parity.csv, parity.md and parity.json into --out; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from replaykit.testing.parity import matrix
from replaykit.testing.parity.scenario import quiet_replay_warnings
from replaykit.workflow import tables
from replaykit.workflow.fingerprint import fingerprint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="one scenario per task (a CPU smoke run)")
    ap.add_argument(
        "--no-unsafe", action="store_true", help="skip the arms that switch a protection off"
    )
    args = ap.parse_args(argv)
    quiet_replay_warnings()
    if args.quick:
        scenarios = matrix.matrix(
            accumulations=[2],
            layouts=["contiguous"],
            precisions=["32"],
            partial_layouts=[],
            device=args.device,
        )
    else:
        scenarios = matrix.matrix(device=args.device)
    results = list(matrix.run_matrix(scenarios, with_unsafe=not args.no_unsafe))
    df = matrix.frame(results)
    passed = sum(r.passed for r in results)
    replay = df[df["arm"] == "replay"]
    unsafe = df[df["arm"] != "replay"]
    line = (
        f"{passed}/{len(results)} scenarios passed; replay arm: {int(replay['equal'].sum())}/{len(replay)} bitwise equal; "
        f"unsafe arms: {int((~unsafe['equal']).sum())}/{len(unsafe)} diverged as expected"
    )
    cols = [
        "scenario",
        "arm",
        "expected",
        "equal",
        "ok",
        "tensors_differing",
        "recordings",
        "replays",
        "eager_reasons",
        "native_step_ms",
        "arm_step_ms",
        "error",
    ]
    records = df.to_dict("records")
    print(tables.text(records, cols))
    print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out / "parity.csv", index=False)
        (args.out / "parity.md").write_text(tables.markdown(records, cols) + f"\n\n{line}\n")
        (args.out / "parity.json").write_text(
            json.dumps(
                {"summary": line, "fingerprint": fingerprint(), "rows": df.to_dict("records")},
                default=str,
                indent=1,
            )
        )
        print(f"wrote {args.out}/parity.csv, parity.md, parity.json")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
