"""A forward's helper counts calls in a function attribute (`helper.calls += 1`) and picks a
weight from it. rk.capture's recording call runs the forward several times (probe, reference,
capture) and does not put the attribute back: the counter, and so the weights, differ from eager
at the first call (the recording is then routed eager as 'diverged', but the damage is done)."""

import sys

import torch
from torch import nn

import replaykit as rk


def helper(h):
    helper.calls += 1
    return h * (1.0 if helper.calls < 3 else 0.5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return helper(self.b(self.a(x).relu()))


def run(use_rk, entry):
    helper.calls = 0
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        return ((m(x) - y) ** 2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and entry == "step" else None
    if use_rk and entry == "capture":
        rk.capture(m, backend="emulated")
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], helper.calls


bad = False
for entry in ("capture", "step"):
    (pe, ce), (pr, cr) = run(False, entry), run(True, entry)
    same = all(torch.equal(a, b) for a, b in zip(pe, pr, strict=False))
    print(f"{entry}: params equal={same}  helper.calls eager={ce} replaykit={cr}")
    bad |= (not same) or ce != cr
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
