"""Exact but a regression (6ee94b3): the stand-in nn.Parameter(p.detach()) drops the Python
attributes on the critic's weight, so a critic forward reading one (an lr/gain multiplier) fails
inside the capture and the step retires with "capture failed: AttributeError: 'Parameter' object
has no attribute 'gain'" (482bfb5 replayed it bitwise). Same for a Parameter subclass."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class EqLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight * self.weight.gain, self.bias)


torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 6))
D = EqLinear(6, 1)
D.weight.gain = 0.5
opt = torch.optim.SGD(G.parameters(), lr=0.05, fused=True)
step = rk.TrainStep(G, lambda g, z: -D(g(z)).mean(), opt, backend="emulated")
for _i in range(4):
    step(torch.randn(5, 4))
print(step.counts["replay"], "replays;", step.retire_reason if step.retired else "not retired")
