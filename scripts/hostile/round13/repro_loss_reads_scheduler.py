"""SILENT: rk.TrainStep whose loss_fn ramps an auxiliary weight from the LR scheduler's step count
(`sched.last_epoch`, a common global-step counter). The scheduler (a torch object the closure
holds) is keyed by identity only, so every replay keeps the recorded weight. Exits 1 on a difference."""

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
    opt = torch.optim.SGD(M.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def loss_fn(m, x, y):
        out = m(x)
        ramp = min(1.0, sched.last_epoch / 4)  # auxiliary term ramped in over 4 steps
        return F.cross_entropy(out, y) + ramp * out.pow(2).mean()

    step = rk.TrainStep(M, loss_fn, opt, backend="emulated") if use_rk else None
    hist = []
    for i in range(6):
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
