"""A Python attribute on the INPUT tensor (a tag the data pipeline sets, `x.weight = 0.5` on
augmented batches) read by the forward (rk.capture) or loss_fn (TrainStep): the signature keys
shape/dtype/strides only, so the replay keeps the recording's value. No warning."""

import sys
import warnings

import torch
from torch import nn

import replaykit as rk


class Net(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * getattr(x, "weight", 1.0)


def run(entry, use_rk):
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        return ((m(x) - y) ** 2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and entry == "step" else None
    if use_rk and entry == "capture":
        rk.capture(m, backend="emulated")
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        x.weight = 1.0 if i < 3 else 0.5
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


warnings.simplefilter("error")
bad = False
for entry in ("step", "capture"):
    same = all(torch.equal(a, b) for a, b in zip(run(entry, False), run(entry, True), strict=False))
    print(f"{entry}: params equal={same}")
    bad |= not same
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
