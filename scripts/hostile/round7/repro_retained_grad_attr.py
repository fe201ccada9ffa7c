"""`h.retain_grad(); self.h = h` in forward, the loop reads `model.h.grad` (saliency). Eager: the
gradient. Replay: None, no reason (documented: the bound copy does not require grad)."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")


def forward(self, x):
    h = torch.relu(self[0](x))
    h.retain_grad()
    self.h = h
    return self[1](h)


def run(replay):
    torch.manual_seed(0)
    m = type("Net", (nn.Sequential,), {"forward": forward})(nn.Linear(8, 16), nn.Linear(16, 4))
    lf = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = rk.TrainStep(
        m, lf, torch.optim.SGD(m.parameters(), lr=0.1), backend="emulated", replay=replay
    )
    g, grads = torch.Generator().manual_seed(1), []
    for _ in range(6):
        step(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        grads.append(m.h.grad)
    return grads, step.counts["replay"]


(e, _), (r, n) = run(False), run(True)
print(
    "replays:", n, "| h.grad None: eager", [g is None for g in e], "replay", [g is None for g in r]
)
same = all(
    (a is None) == (b is None) and (a is None or torch.equal(a, b))
    for a, b in zip(e, r, strict=False)
)
print("SAME" if same else "DIFF")
