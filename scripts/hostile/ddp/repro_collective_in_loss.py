"""SILENT DIFF repro: a TrainStep over DDP whose loss_fn all-reduces a count across the ranks
(the loss normalised by the global number of labelled items, as LLM trainers do). Replayed calls
end with different losses / weights than the eager twin, with no reason or warning.

    cd /work/wt/hostile2 && PYTHONPATH=$PWD OMP_NUM_THREADS=1 \
        /work/main/.venv/bin/python scripts/hostile/ddp/repro_collective_in_loss.py [--no-bn] [--local]

``--local``: the same loss with the rank's own count (no collective): bitwise.
Prints, per call and per rank, the route and which tensors differ from the twin after the call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def run(replay: bool, arg_model: bool, bn: bool):
    import replaykit as rk

    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = (
        [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU(), nn.Linear(16, 4)]
    )
    net = nn.Sequential(*layers)
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(model, x, y):
        count = (y != -100).sum().float()
        if not arg_model:
            dist.all_reduce(count)
        loss = nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
        return loss / count

    step = rk.TrainStep(ddp, loss_fn, opt, max_norm=1.0, replay=replay,
                        **({"backend": "emulated"} if replay else {}))  # fmt: skip
    # HK_SAME_DATA=1: both ranks see the same batches (averaging then changes nothing)
    g = torch.Generator().manual_seed(100 + (0 if os.environ.get("HK_SAME_DATA") else rank))
    snaps = []
    for _ in range(8):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        y[torch.rand(8, generator=g) < 0.3] = -100  # padding
        loss = step(x, y)
        snap = {n: t.detach().clone() for n, t in [*net.named_parameters(), *net.named_buffers()]}
        snap["loss"] = loss.clone()
        snaps.append(snap)
    routes = {}
    for e in step.journal:
        if e.kind in ("replay", "record", "eager") and e.call not in routes:
            routes[e.call] = e.kind + (f":{e.reason}" if e.kind == "eager" else "")
    return snaps, routes


def worker(arg_model: bool, bn: bool) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        twin, _ = run(False, arg_model, bn)
        rep, routes = run(True, arg_model, bn)
    for i, (a, b) in enumerate(zip(twin, rep, strict=True)):
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        print(f"rank{rank} call {i + 1} {routes.get(i + 1, '?'):>22}: "
              f"{'bitwise' if not bad else 'DIFF ' + ','.join(bad)}", flush=True)  # fmt: skip
    if os.environ.get("HK_DEBUG"):  # did a replayed call move the weights at all?
        for i in range(4, len(rep)):
            still = [k for k in rep[i] if k != "loss" and torch.equal(rep[i][k], rep[i - 1][k])]
            print(f"rank{rank} call {i + 1}: unchanged since call {i}: {still}", flush=True)
    replay_warnings = [str(x.message)[:120] for x in w if "Replay" in x.category.__name__]
    print(f"rank{rank} ReplayWarnings: {replay_warnings}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    arg_model, bn = "--local" in sys.argv, "--no-bn" not in sys.argv
    if os.environ.get("HK_WORKER"):
        worker(arg_model, bn)
        return 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = {**os.environ, "HK_WORKER": "1", "RANK": str(r), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    rc = 0
    for p in procs:
        try:
            rc |= p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print("HANG: killed")
            return 2
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
