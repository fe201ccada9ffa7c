"""Saliency/Grad-CAM style: the forward keeps an activation whose gradient it retains
(`h.retain_grad(); self.h = h`) and the loop reads `model.h.grad` after each step.
Eager: the activation's gradient. Replay: None, with no reason given (the bound copy does not
require grad: documented for requires_grad, but .grad is a value the user reads)."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h.retain_grad()
        self.h = h
        return self.l2(h)


def run(replay):
    torch.manual_seed(0)
    m = Net()
    step = rk.TrainStep(
        m,
        lambda m, x, y: F.cross_entropy(m(x), y),
        torch.optim.SGD(m.parameters(), lr=0.1),
        backend="emulated",
        replay=replay,
    )
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(6):
        step(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        grads.append(m.h.grad)
    return grads, step.counts["replay"]


e, _ = run(False)
r, n = run(True)
print(
    "replays:", n, "| h.grad None: eager", [g is None for g in e], "replay", [g is None for g in r]
)
print(
    "SAME"
    if all(
        (a is None) == (b is None) and (a is None or torch.equal(a, b))
        for a, b in zip(e, r, strict=False)
    )
    else "DIFF"
)
