"""Diagnostic: which c10d ops a DDP TrainStep's recording put on its tape (emulated backend).

    cd /work/wt/hostile2 && PYTHONPATH=$PWD OMP_NUM_THREADS=1 \
        /work/main/.venv/bin/python scripts/hostile/ddp/diag_tape_collectives.py

Runs 2 gloo ranks over three loss functions (the documented one, a DDP-wrapper closure, an
all_reduce in the loss) and prints, per recording, the non-aten ops on its tape: a c10d op there
is replayed from the tape, its Work never waited on.
"""

import os
import subprocess
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker() -> None:
    import replaykit as rk

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    for kind in ("argument", "ddp_closure", "allreduce_in_loss"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        ddp = DDP(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

        def loss_fn(model, x, y, kind=kind, ddp=ddp):
            if kind == "ddp_closure":
                return nn.functional.cross_entropy(ddp(x), y)
            out = nn.functional.cross_entropy(model(x), y, reduction="sum")
            n = torch.tensor(float(len(y)))
            if kind == "allreduce_in_loss":
                dist.all_reduce(n)
            return out / n

        step = rk.TrainStep(ddp, loss_fn, opt, backend="emulated")
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(5):
            step(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
        for rec in step._recordings.values():  # diagnostic only: the tape's op names
            names = Counter(str(getattr(op, "func", op)) for op in rec.region.tape._ops)
            other = {k: v for k, v in names.items() if "aten." not in k}
            if rank == 0:
                print(f"{kind}: {sum(names.values())} ops; non-aten: {other}", flush=True)
        step.release()
    dist.destroy_process_group()


if os.environ.get("HK_WORKER"):
    worker()
else:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"HK_WORKER": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__],
            env={**os.environ, **base, "RANK": str(r), "MASTER_PORT": str(port)},
        )
        for r in range(2)
    ]
    for p in procs:
        p.wait(timeout=180)
