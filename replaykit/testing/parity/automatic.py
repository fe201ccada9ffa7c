"""The automatic-optimization step arm of the parity matrix, from the command line (a shard of it).

    python -m replaykit.testing.parity.automatic --device cuda --shard 0/4 --json out.json

Each scenario of :func:`~replaykit.testing.parity.matrix.automatic_matrix` trains ``native``
and ``step`` (``ReplayCallback("net", optimizer_step=True)``), which must end bitwise equal;
with ``--unsafe`` (``first``: the first scenario of each task and precision; ``all``) the step
arm's unsafe arms run too and must diverge. Shards split the scenarios so that several
processes share one GPU; ``--merge`` reads the shards' JSON files and prints the totals.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .scenario import PRECISIONS, quiet_replay_warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--accumulations", default="1,2,4")
    ap.add_argument("--tasks", default="detection,pose,oriented,segmentation")
    ap.add_argument("--optimizer", default="auto", help="auto: sgd, fused under 16-mixed")
    ap.add_argument("--shard", default="0/1", help="i/n: every n-th scenario from the i-th")
    ap.add_argument("--unsafe", choices=("none", "first", "all"), default="first")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--merge", type=Path, nargs="*", help="shard JSON files to total")
    args = ap.parse_args(argv)
    if args.merge:
        rows = [r for f in args.merge for r in json.loads(f.read_text())["rows"]]
        return _report(rows)
    from .arms import STEP_ARM
    from .matrix import automatic_matrix, rows, run_matrix

    quiet_replay_warnings()
    scenarios = automatic_matrix(
        tasks=args.tasks.split(","),
        precisions=args.precisions.split(","),
        accumulations=[int(a) for a in args.accumulations.split(",")],
        device=args.device,
        optimizer=args.optimizer,
    )
    i, n = map(int, args.shard.split("/"))
    seen: set[tuple[str, str]] = set()
    results = []
    for k, scenario in enumerate(scenarios):
        first = (scenario.task, scenario.precision) not in seen
        seen.add((scenario.task, scenario.precision))
        if k % n != i:
            continue
        unsafe = args.unsafe == "all" or (args.unsafe == "first" and first)
        results += list(run_matrix([scenario], with_unsafe=unsafe, progress=False, arm=STEP_ARM))
        if args.json:  # after every scenario: a shard cut short by its deadline keeps what ran
            args.json.write_text(json.dumps({"rows": rows(results)}, default=str))
    return _report(rows(results))


def _report(table: list[dict]) -> int:
    step = [r for r in table if r["arm"] == "step"]
    unsafe = [r for r in table if r["arm"] != "step"]
    failed = [
        f"{r['scenario']} [{r['arm']}]: {r['error'] or r['tensors_differing']}"
        for r in table
        if not r["ok"]
    ]
    replayed = sum(r["step_replays"] > 0 for r in step)
    print(
        f"automatic step arm: {sum(r['equal'] for r in step)}/{len(step)} bitwise equal to native "
        f"({replayed} replayed the optimizer step); unsafe arms: "
        f"{sum(not r['equal'] for r in unsafe)}/{len(unsafe)} diverged; not ok: {len(failed)}"
    )
    for line in failed[:20]:
        print("  FAIL", line)
    reasons: dict[str, int] = {}
    for r in step:
        for reason, count in r["step_eager_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    print("  optimizer step eager reasons:", reasons)
    retired: dict[str, int] = {}
    for r in step:
        if r.get("step_retired"):
            retired[r["step_retired"]] = retired.get(r["step_retired"], 0) + 1
    for why, count in retired.items():
        print(f"  optimizer step retired ({count}): {why}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
