"""whole_step under Lightning's DDP strategy on the one-GPU stand-in: two ranks, gloo, cuda:0.

    python scripts/gpu/lightning_ddp_check.py --out runs/lightning_ddp_check          # GPU host (< 500 s)
    python scripts/gpu/lightning_ddp_check.py --device cpu --quick --out /tmp/lddp    # on CPUs (emulated)

The parity matrix: precision (32, bf16-mixed, 16-mixed with a GradScaler and fused SGD) x
accumulation (1, 2, 4), each case one two-rank launch under its own timeout:
``replaykit.lightning.whole_step`` in ``training_step`` (manual optimization, Trainer precision
32, ``DDPStrategy(parallel_devices=[cuda:0, cuda:0], process_group_backend="gloo")``) against
native Lightning manual-optimization DDP, bitwise on every rank (weights, BatchNorm buffers,
momentum, losses), ranks equal, with each rank's replay count. PASS needs equal, ranks agreeing
and replays on both ranks. A last row: rank 1 alone changes dropout's p at call 4; both ranks
must run it eagerly (``peer_route``) and stay equal, while the unsafe arm (``rank_agreement``
off) must differ.

Writes lightning_ddp_check.json and .md under --out and prints the table.
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

from replaykit.testing.parity.lightning_ddp_step import Case, compare

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
ACCUMULATIONS = (1, 2, 4)


def _run(case: Case, timeout: float, pg_timeout: float) -> tuple[dict | None, str]:
    try:
        (result,) = compare([case], timeout=timeout, pg_timeout=pg_timeout)
    except RuntimeError as exc:  # a failed or late launch: every rank was stopped
        return None, str(exc)[-600:]
    return result, ""


def _case_row(
    precision: str, acc: int, device: str, timeout: float, deadline: float, quick: bool
) -> dict:
    row: dict = {"precision": precision, "accumulate": acc}
    if time.monotonic() > deadline:
        return {**row, "verdict": "SKIP", "why": "time budget spent"}
    t0 = time.monotonic()
    case = Case(precision=precision, accumulate=acc, device=device, steps=4 if quick else 6)
    result, error = _run(case, timeout, timeout)
    if result is None:
        return {**row, "verdict": "FAIL", "why": error}
    r = result["whole_step"]
    ok = r["equal"] and r["ranks_agree"] and min(r["replay"]) > 0
    ok = ok and result["native"]["ranks_agree"] and r["routes"][0] == r["routes"][1]
    why = "" if ok else f"diffs {r['diffs']} errors {r['errors']} {r['summaries']}"
    return {
        **row, "verdict": "PASS" if ok else "FAIL", "replays": r["replay"],
        "routes": r["routes"][0], "seconds": round(time.monotonic() - t0, 1), "why": why[-600:],
    }  # fmt: skip


def matrix(device: str, timeout: float, deadline: float, quick: bool, jobs: int = 1) -> list[dict]:
    """Every case, ``jobs`` two-rank launches at a time; the rank-1 change last."""
    from concurrent.futures import ThreadPoolExecutor

    grid = [(p, a) for p in PRECISIONS for a in ACCUMULATIONS]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        rows = list(pool.map(lambda pa: _case_row(*pa, device, timeout, deadline, quick), grid))
    rows.append(_rank1_change(device, timeout))
    return rows


def _rank1_change(device: str, timeout: float) -> dict:
    row: dict = {"precision": "32", "accumulate": "rank 1 alone changes dropout.p at call 4"}
    case = Case(arms=("native", "whole_step", "unsafe"), device=device, steps=6, rank1_change=4)
    t0 = time.monotonic()
    result, error = _run(case, timeout, 10)
    if result is None:
        return {**row, "verdict": "FAIL", "why": error}
    r, unsafe = result["whole_step"], result["unsafe"]
    ok = (
        r["equal"] and r["ranks_agree"] and r["routes"][0] == r["routes"][1]
        and r["routes"][0][3] == "eager:peer_route" and not unsafe["equal"]
    )  # fmt: skip
    why = f"routes {r['routes'][0]}; unsafe equal={unsafe['equal']} routes {unsafe['routes']}"
    return {
        **row, "verdict": "PASS" if ok else "FAIL", "replays": r["replay"],
        "seconds": round(time.monotonic() - t0, 1), "why": why,
    }  # fmt: skip


def markdown(device: str, rows: list[dict]) -> str:
    out = [
        f"## whole_step under Lightning DDP, two ranks (gloo) on {device}",
        "",
        "| precision | accumulate | verdict | replays per rank | s | why |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['precision']} | {r['accumulate']} | {r['verdict']} | {r.get('replays', '')} "
            f"| {r.get('seconds', '')} | {r.get('why', '')[:200]} |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda (every rank on cuda:0) or cpu")
    ap.add_argument("--out", type=Path, required=True, help="folder for the .json and .md")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per case (ranks killed)")
    ap.add_argument("--budget", type=float, default=420, help="seconds before no new case starts")
    ap.add_argument("--quick", action="store_true", help="fewer steps per case")
    ap.add_argument("--jobs", type=int, default=1, help="cases launched side by side")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget
    rows = matrix(args.device, args.timeout, deadline, args.quick, args.jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lightning_ddp_check.json").write_text(json.dumps(rows, indent=1, default=str))
    text = markdown(args.device, rows)
    (args.out / "lightning_ddp_check.md").write_text(text)
    print(text)
    failed = [r for r in rows if r["verdict"] != "PASS"]
    print(f"lightning_ddp_check: {len(rows) - len(failed)}/{len(rows)} PASS; written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
