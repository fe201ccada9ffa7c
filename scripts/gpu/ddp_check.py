"""rk.TrainStep over DDP on the one-GPU stand-in: two ranks, gloo, every rank's tensors on cuda:0.

    python scripts/gpu/ddp_check.py --out runs/ddp_check            # on the GPU host (< 300 s)
    python scripts/gpu/ddp_check.py --device cpu --quick --out /tmp/ddp   # the same on CPUs (emulated)

1. The parity matrix: precision (32, bf16-mixed, 16-mixed with a GradScaler and fused SGD) x
   accumulation (1, 2, 4), each case one two-rank launch under its own timeout: the replayed
   whole step (two-graph form: forward+backward replayed, DDP's bucketed all-reduce between,
   clip+optimizer replayed) against eager DDP, bitwise on every rank, ranks equal, with each
   rank's replay count. PASS needs equal, ranks agreeing and replays on both ranks.
2. The benchmark, ms per optimizer step per rank, at a launch-bound size (MLP 8x256, batch 32)
   and a medium one (MLP 8x1024, batch 256): native DDP eager, network replay
   (rk.capture(ddp.module) + OptimizerStep), the replayed whole step, the same with
   replay_timeout (the watchdog on), one all-reduce of the gradients' size alone (the floor),
   and the route agreement alone (its per-step cost).

Writes ddp_check.json and ddp_check.md under --out and prints the tables. NCCL and collectives
inside the graphs are not run here (one GPU): see docs/limits.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])
)

from replaykit.testing.parity.ddp_step import Case, compare, launch

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
ACCUMULATIONS = (1, 2, 4)
BENCH_ARMS = ("native", "capture+step", "trainstep", "trainstep+watchdog", "allreduce", "agree")
SIZES = {
    "launch-bound (MLP 8x256, batch 32)": (8, 256, 32),
    "medium (MLP 8x1024, batch 256)": (8, 1024, 256),
}


def matrix(device: str, timeout: float, deadline: float, quick: bool) -> list[dict]:
    rows = []
    short, long = (5, 4) if quick else (8, 6)  # optimizer steps: 3 eager, a recording, replays
    for precision in PRECISIONS:
        for acc in ACCUMULATIONS:
            case = Case(
                precision=precision,
                accumulate=acc,
                device=device,
                steps=short if acc == 1 else long,
            )
            row = {"precision": precision, "accumulate": acc}
            if time.monotonic() > deadline:
                rows.append({**row, "verdict": "SKIP", "why": "time budget spent"})
                continue
            t0 = time.monotonic()
            try:
                left = min(timeout, deadline + 60 - time.monotonic())  # the budget's end
                (result,) = compare([case], timeout=max(left, 10), pg_timeout=timeout)
            except RuntimeError as exc:
                rows.append({**row, "verdict": "FAIL", "why": str(exc)[-600:]})
                continue
            r = result["trainstep"]
            ok = r["equal"] and r["ranks_agree"] and min(r["replay"]) > 0
            why = "" if ok else f"diffs {r['diffs']} errors {r['errors']} {r['summaries']}"
            rows.append({
                **row, "verdict": "PASS" if ok else "FAIL", "equal": r["equal"],
                "ranks_agree": r["ranks_agree"], "replays": r["replay"], "routes": r["routes"][0],
                "seconds": round(time.monotonic() - t0, 1), "why": why[-600:],
            })  # fmt: skip
    rows.append(_rank1_change(device, timeout))
    return rows


def _rank1_change(device: str, timeout: float) -> dict:
    """Rank 1 alone meets a re-record trigger at call 6: both ranks run it eagerly
    (``peer_route``); with the agreement off (the unsafe arm) the ranks' routes split and the
    result differs."""
    row: dict = {"precision": "32", "accumulate": "rank 1 alone changes dropout.p at call 6"}
    case = Case(
        arms=("native", "trainstep", "unsafe"), device=device, steps=7, rank1_change=6,
        replay_timeout=5.0,
    )  # fmt: skip
    try:
        (result,) = compare([case], timeout=timeout, pg_timeout=10)
    except RuntimeError as exc:
        return {**row, "verdict": "FAIL", "why": str(exc)[-600:]}
    r, unsafe = result["trainstep"], result["unsafe"]
    ok = (
        r["equal"] and r["ranks_agree"] and r["routes"][0] == r["routes"][1]
        and r["routes"][0][5] == "eager:peer_route" and not unsafe["equal"]
    )  # fmt: skip
    why = f"routes {r['routes'][0]}; unsafe equal={unsafe['equal']} routes {unsafe['routes']}"
    return {**row, "verdict": "PASS" if ok else "FAIL", "replays": r["replay"], "why": why}


def bench(device: str, steps: int, timeout: float, deadline: float, quick: bool) -> list[dict]:
    rows = []
    sizes = list(SIZES.items())[:1] if quick else SIZES.items()
    for label, (depth, width, batch) in sizes:
        if time.monotonic() > deadline:
            rows.append({"size": label, "skipped": "time budget spent"})
            continue
        case = Case(
            device=device, depth=depth, width=width, batch=batch, bench=steps, arms=BENCH_ARMS
        )
        try:
            left = min(timeout, deadline + 20 - time.monotonic())  # the budget's end
            ranks = launch([case], timeout=max(left, 10), pg_timeout=timeout)
        except RuntimeError as exc:
            rows.append({"size": label, "error": str(exc)[-600:]})
            continue
        row: dict = {"size": label}
        for arm in BENCH_ARMS:
            per_rank = [r[0][arm] for r in ranks]
            row[arm] = [round(x["ms"], 4) for x in per_rank]
            if "replay" in per_rank[0]:
                row[f"{arm} replays"] = [x["replay"] for x in per_rank]
        rows.append(row)
    return rows


def markdown(device: str, rows: list[dict], perf: list[dict]) -> str:
    out = [f"## TrainStep over DDP, two ranks (gloo) on {device}", "",
           "| precision | accumulate | verdict | replays per rank | s | why |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['precision']} | {r['accumulate']} | {r['verdict']} | {r.get('replays', '')} "
            f"| {r.get('seconds', '')} | {r.get('why', '')[:200]} |"
        )
    out += [
        "",
        "ms per optimizer step per rank (rank 0, rank 1); `agree`: the route agreement alone",
        "",
    ]
    out += ["| size | " + " | ".join(BENCH_ARMS) + " |", "|---" * (len(BENCH_ARMS) + 1) + "|"]
    for r in perf:
        cells = [
            ", ".join(f"{v:.3f}" for v in r[a])
            if a in r
            else r.get("error", r.get("skipped", ""))[:80]
            for a in BENCH_ARMS
        ]
        out.append(f"| {r['size']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda (every rank on cuda:0) or cpu")
    ap.add_argument("--out", type=Path, required=True, help="folder for ddp_check.json and .md")
    ap.add_argument(
        "--timeout", type=float, default=90, help="seconds per case (every rank killed past it)"
    )
    ap.add_argument("--budget", type=float, default=250, help="seconds before no new case starts")
    ap.add_argument("--quick", action="store_true", help="fewer steps, one benchmark size")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget
    rows = matrix(
        args.device, args.timeout, deadline - 60, args.quick
    )  # leave time for the benchmark
    steps = 10 if args.quick else 200
    perf = bench(args.device, steps, args.timeout, deadline, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ddp_check.json").write_text(
        json.dumps({"matrix": rows, "bench": perf}, indent=1, default=str)
    )
    text = markdown(args.device, rows, perf)
    (args.out / "ddp_check.md").write_text(text)
    print(text)
    failed = [r for r in rows if r["verdict"] != "PASS"]
    print(f"ddp_check: {len(rows) - len(failed)}/{len(rows)} PASS; written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
