"""SILENT: rk.TrainStep whose loss_fn adds an L2 term scaled by the optimizer's current float lr
(StepLR halves it every 2 steps). Once the float lr has varied, the optimizer step leaves the graph
and its host values stop keying the recordings, yet the replayed loss keeps the recorded lr.
Exits 1 on a difference."""

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")


def train(use_rk):
    torch.manual_seed(0)
    M = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def loss_fn(m, x, y):
        out = m(x)
        lr = opt.param_groups[0]["lr"]  # L2 scaled by the current (float) lr
        return F.cross_entropy(out, y) + lr * 0.1 * sum(p.pow(2).sum() for p in m.parameters())

    step = rk.TrainStep(M, loss_fn, opt, backend="emulated") if use_rk else None
    hist = []
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if use_rk:
            loss = step(x, y)
        else:
            loss = loss_fn(M, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        sched.step()
        hist.append((loss, [p.detach().clone() for p in M.parameters()]))
    return hist, step


eager, _ = train(False)
replayed, step = train(True)
print(step.summary())
for i, ((la, pa), (lb, pb)) in enumerate(zip(eager, replayed, strict=False)):
    if not torch.equal(la, lb) or not all(map(torch.equal, pa, pb)):
        print(f"SILENT: step {i}: loss {la.item():.6f} vs {lb.item():.6f}")
        sys.exit(1)
print("equal")
