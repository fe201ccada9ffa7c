"""A loss_fn that is an instance of a plain callable class: its class attributes are neither keyed
nor put back. (a) `Focal.gamma = 1.5` set by the loop at step 3: frozen. (b) `type(self).calls += 1`
counted in __call__: twice at the recording call, never at a replay. No warning."""

import sys
import warnings

import torch
from torch import nn

import replaykit as rk


class Focal:
    gamma = 2.0
    calls = 0

    def __call__(self, m, x, y):
        type(self).calls += 1
        return ((m(x) - y).abs() ** self.gamma).mean()


def run(use_rk):
    Focal.gamma, Focal.calls = 2.0, 0
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
    crit = Focal()
    step = rk.TrainStep(m, crit, opt, backend="emulated") if use_rk else None
    for i in range(6):
        if i == 3:
            Focal.gamma = 1.5
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if use_rk:
            step(x, y)
        else:
            crit(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], Focal.calls


warnings.simplefilter("ignore")  # a retirement warns now: the exit code says equal or not
(pe, ce), (pr, cr) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(pe, pr, strict=False))
print(f"params equal={same}  Focal.calls eager={ce} replaykit={cr}")
bad = (not same) or ce != cr
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
