"""Function attributes are neither keyed nor put back (no warning). TrainStep: loss_fn reads `lf.aux`
(set at step 3: frozen), counts `lf.calls` (2x at recording, 0x at replays); capture: `scaled.scale` frozen."""

import sys
import warnings

import torch
from torch import nn

import replaykit as rk


def data(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def scaled(h):
    return h * scaled.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return scaled(self.b(self.a(x).relu()))


def lf(m, x, y):
    lf.calls += 1
    out = m(x)
    return ((out - y) ** 2).mean() + lf.aux * out.pow(2).mean()


def run(entry, use_rk):
    scaled.scale, lf.aux, lf.calls = 1.0, 0.0, 0
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and entry == "step" else None
    if use_rk and entry == "capture":
        rk.capture(m, backend="emulated")
    for i in range(6):
        if i == 3:
            lf.aux, scaled.scale = 0.5, 0.5
        if step is not None:
            step(*data(i))
        else:
            loss = lf(m, *data(i))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], lf.calls


warnings.simplefilter("ignore")  # a retirement warns now: the exit code says equal or not
bad = False
for entry in ("step", "capture"):
    (pe, ce), (pr, cr) = run(entry, False), run(entry, True)
    same = all(torch.equal(a, b) for a, b in zip(pe, pr, strict=False))
    print(f"{entry}: params equal={same}  lf.calls eager={ce} replaykit={cr}")
    bad |= (not same) or ce != cr
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
