"""Where the whole step's time over the raw graph goes, launch-bound size, arms interleaved in one
process: the raw graph (nothing handed back), the raw graph handing back ``loss.clone()`` as the
step does, and ``TrainStep``; then the host time of one call of each (no sync: what Python adds).
``PYTHONPATH=. python scripts/gpu/step_floor.py [--steps 200 --rounds 6]``."""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from replaykit.step import TrainStep
from replaykit.testing.bench.timing import SIZES, heads_loss
from replaykit.testing.nets import DetectionNet

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--rounds", type=int, default=6)
args = ap.parse_args()
size = SIZES[0]
torch.manual_seed(0)
base = DetectionNet(width=size.width, depth=size.depth).cuda()
g = torch.Generator().manual_seed(1)
xs = [
    torch.randn(size.batch, 3, size.image, size.image, generator=g).cuda()
    for _ in range(args.steps)
]


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=True)


def raw(clone: bool):
    m = copy.deepcopy(base)
    opt = sgd(m)
    sx = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            heads_loss(m(sx)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = heads_loss(m(sx))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(x):
        sx.copy_(x)
        graph.replay()
        return loss.clone() if clone else None

    return step


def trainstep():
    m = copy.deepcopy(base)
    return TrainStep(m, lambda m, x: heads_loss(m(x)), sgd(m), backend="cuda")


arms = {"raw": raw(False), "raw+clone": raw(True), "TrainStep": trainstep()}
for f in arms.values():
    for x in xs[:8]:
        f(x)
torch.cuda.synchronize()
times = {n: [] for n in arms}
host = {n: [] for n in arms}
for _ in range(args.rounds):
    for n, f in arms.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in xs:
            f(x)
        torch.cuda.synchronize()
        times[n].append((time.perf_counter() - t0) * 1e3 / len(xs))
        for x in xs[:50]:  # host time of one call, the queue drained first
            torch.cuda.synchronize()
            t = time.perf_counter()
            f(x)
            host[n].append((time.perf_counter() - t) * 1e6)
rawm = statistics.median(times["raw"])
for n in arms:
    m = statistics.median(times[n])
    print(
        f"{n:10s} {m:.4f} ms/step  x{m / rawm:.4f} raw  host {statistics.median(host[n]):.1f} us/call"
    )
print("counts", arms["TrainStep"].counts)
