"""SILENT: rk.TrainStep; at step 3 the head moves from the backbone's param group (lr 0.01) to a
fast group (lr 0.1) by editing the groups' 'params' lists (layer-wise lr re-assignment). Eager
steps the head with the new lr; the replays keep the recorded grouping. Exits 1 on a difference."""

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
    opt = torch.optim.SGD(
        [{"params": list(M.parameters()), "lr": 0.01}, {"params": [], "lr": 0.1}], momentum=0.9
    )

    def lf(m, x, y):
        return F.cross_entropy(m(x), y)

    step = rk.TrainStep(M, lf, opt, backend="emulated") if use_rk else None
    hist = []
    for i in range(6):
        if i == 3:  # move the head into the fast group
            slow, fast = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
            for p in M[2].parameters():
                del slow[[id(q) for q in slow].index(id(p))]
                fast.append(p)
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if use_rk:
            step(x, y)
        else:
            lf(M, x, y).backward()
            opt.step()
            opt.zero_grad()
        hist.append([p.detach().clone() for p in M.parameters()])
    return hist, step


eager, _ = train(False)
replayed, step = train(True)
print(step.summary())
for i, (a, b) in enumerate(zip(eager, replayed, strict=False)):
    bad = [k for k, (p, q) in enumerate(zip(a, b, strict=False)) if not torch.equal(p, q)]
    if bad:
        print(
            f"SILENT: step {i}: parameters {bad} differ, max abs "
            f"{max((a[k] - b[k]).abs().max().item() for k in bad):.3g}"
        )
        sys.exit(1)
print("equal")
