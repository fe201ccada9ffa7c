"""SILENT: step(x, x, y) - the same tensor passed twice. Each argument gets its own static copy,
so inside the recording `q is k` is False: nn.MultiheadAttention takes its other path (other
bits), and a loss_fn branching on `a is b` takes the other branch for ever."""
import torch
from torch import nn
import replaykit as rk


def loss_fn(m, a, b, y):
    out = m(a)
    return nn.functional.cross_entropy(out, y) * (1.0 if a is b else 2.0)


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(6, 8, generator=g)
        losses.append(step(x, x, torch.randint(0, 4, (6,), generator=g)))
    return losses, model, step


(l0, m0, _), (l1, m1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(l0, l1)) and torch.equal(m0[0].weight, m1[0].weight)
print("equal:", same, "| journal reasons:", dict(step.eager_reasons), step.retire_reason)
assert same, "SILENT"
