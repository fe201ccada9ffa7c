"""SILENT: rk.TrainStep whose loss_fn draws a fixed noise under torch.random.fork_rng() +
torch.manual_seed(3) (reproducible perturbation for a consistency term). The recording call's
check agrees (both runs reseed); every replay draws from the global generator instead.
(rk.capture routes the same reseed in a forward eager, 'diverged'.) Exits 1 on a difference."""

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")


def loss_fn(m, x, y):
    with torch.random.fork_rng():
        torch.manual_seed(3)
        noise = 0.1 * torch.randn_like(x)
    out = m(x)
    return F.cross_entropy(out, y) + F.mse_loss(m(x + noise), out.detach())


def train(use_rk):
    torch.manual_seed(0)
    M = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9, fused=True)
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
        hist.append((loss, [p.detach().clone() for p in M.parameters()]))
    return hist, step


eager, _ = train(False)
replayed, step = train(True)
print(step.summary())
for i, ((la, pa), (lb, pb)) in enumerate(zip(eager, replayed, strict=False)):
    if not torch.equal(la, lb) or not all(map(torch.equal, pa, pb)):
        print(
            f"SILENT: step {i}: loss {la.item():.6f} vs {lb.item():.6f}, params equal: "
            f"{[torch.equal(p, q) for p, q in zip(pa, pb, strict=False)]}"
        )
        sys.exit(1)
print("equal")
