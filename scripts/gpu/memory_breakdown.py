"""Where an arm's reserved memory sits, step by step: eager's pool against the graphs' private
pools (torch.cuda.memory_snapshot's segments by pool id), for the memory bench's workloads.

    python scripts/gpu/memory_breakdown.py [--workload mlp8x1024_b256] [--arm step] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.getcwd())

import torch

import replaykit as rk
from replaykit.testing.bench.memory import WORKLOADS


def by_pool() -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for seg in torch.cuda.memory_snapshot():
        pool = seg.get("segment_pool_id", (0, 0))
        key = "eager" if tuple(pool) == (0, 0) else f"pool{tuple(pool)}"
        out[key] += seg["total_size"] / 2**20
        out[key + "_used"] += (
            sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated") / 2**20
        )
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", action="append")
    ap.add_argument("--arm", action="append")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    rk.enable_determinism()
    for wname in a.workload or ["mlp8x1024_b256", "tiny_lm"]:
        for arm in a.arm or ["eager", "step", "capture"]:
            w, dev = WORKLOADS[wname], torch.device("cuda")
            torch.manual_seed(0)
            model = w.make().to(dev)
            opt = torch.optim.Adam(
                model.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=True
            )
            g = torch.Generator().manual_seed(1)
            batches = [tuple(t.to(dev) for t in w.batch(g)) for _ in range(a.steps)]
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_reserved() / 2**20
            run = (
                rk.TrainStep(model, lambda m, x, y, w=w: w.loss(m(x), y), opt)
                if arm == "step"
                else None
            )
            rec = rk.capture(model) if arm == "capture" else None
            for i, (x, y) in enumerate(batches):
                if run is not None:
                    run(x, y)
                else:
                    w.loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                pools = {k: round(v, 1) for k, v in by_pool().items()}
                print(
                    f"{wname} {arm} step {i}: alloc {torch.cuda.memory_allocated() / 2**20:.1f} "
                    f"reserved {torch.cuda.memory_reserved() / 2**20 - base:.1f} "
                    f"peak_res {torch.cuda.max_memory_reserved() / 2**20 - base:.1f} "
                    f"peak_alloc {torch.cuda.max_memory_allocated() / 2**20:.1f} {pools}",
                    flush=True,
                )
            if rec is not None:
                print(rec.journal.format()[:1500])
                rec.release()
            if run is not None:
                print(run.journal.format()[:1500])
                run.release()
            del model, opt, run, rec, batches
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
