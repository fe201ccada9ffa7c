"""A Python attribute set on a parameter or buffer (per-parameter `p.decay_mult` read by loss_fn
for an L2 term; `self.scale.temperature` read by forward) is not keyed: the loop changes it at
step 3 and TrainStep keeps replaying the old value. No warning."""

import sys
import warnings

import torch
from torch import nn

import replaykit as rk


class Net(nn.Sequential):
    def __init__(self, *mods):
        super().__init__(*mods)
        self.register_buffer("scale", torch.ones(3))
        self.scale.temperature = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale / self.scale.temperature


def run(case, use_rk):
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    for p in m.parameters():
        p.decay_mult = 1e-3
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        reg = sum(p.decay_mult * p.pow(2).sum() for p in m.parameters())
        return ((m(x) - y) ** 2).mean() + reg

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk else None
    for i in range(6):
        if i == 3:
            if case == "param":
                m[0].weight.decay_mult = 0.5
            else:
                m.scale.temperature = 2.0
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if use_rk:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


warnings.simplefilter("error")
bad = False
for case in ("param", "buffer"):
    same = all(torch.equal(a, b) for a, b in zip(run(case, False), run(case, True), strict=False))
    print(f"{case}: params equal={same}")
    bad |= not same
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
