"""SILENT: rk.TrainStep(accumulate=2); the backbone is frozen on odd epochs; an epoch has 3 batches,
so a freeze lands between the two micro-batches of a cycle (the backbone's .grad from the first one
is still there and eager's optimizer steps it). Exits 1 on a difference."""

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

    def lf(m, x, y):
        return F.cross_entropy(m(x), y)

    if use_rk:
        step = rk.TrainStep(M, lf, opt, accumulate=2, backend="emulated")
    else:  # plain eager: loss / 2, backward, step + zero_grad every 2nd call
        n = [0]

        def step(x, y):
            (lf(M, x, y) / 2).backward()
            n[0] += 1
            if n[0] % 2 == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)

    hist = []
    for epoch in range(4):
        M[0].requires_grad_(epoch % 2 == 0)  # train the backbone on even epochs only
        for b in range(3):
            g = torch.Generator().manual_seed(10 * epoch + b)
            step(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            hist.append([p.detach().clone() for p in M.parameters()])
    return hist, step


eager, _ = train(False)
replayed, step = train(True)
print(step.summary())
for i, (a, b) in enumerate(zip(eager, replayed, strict=False)):
    bad = [k for k, (p, q) in enumerate(zip(a, b, strict=False)) if not torch.equal(p, q)]
    if bad:
        print(
            f"SILENT: call {i}: parameters {bad} differ, max abs "
            f"{max((a[k] - b[k]).abs().max().item() for k in bad):.3g}"
        )
        sys.exit(1)
print("equal")
