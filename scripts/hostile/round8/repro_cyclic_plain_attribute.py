"""A plain attribute holding an object with a reference cycle (a config/logger/trainer with a
back-reference) makes the captured module's call raise a bare RecursionError (no ReplayError)."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class Cfg:
    def __init__(self):
        self.owner = self  # a back-reference (parent <-> child, trainer <-> module)


def run(use_rk):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.cfg = Cfg()
    if use_rk:
        rk.capture(model, backend="emulated", warmup=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g, seen = torch.Generator().manual_seed(1), []
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        seen.append(model[0].weight.detach().clone())
    return seen


e = run(False)
try:
    r = run(True)
    print("SAME" if all(torch.equal(a, b) for a, b in zip(e, r, strict=True)) else "DIFF")
except Exception as ex:  # a clear error would be rk.ReplayError
    print("UNCLEAR", type(ex).__name__, str(ex)[:80])
