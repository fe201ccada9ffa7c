"""SILENT: a loss_fn that normalizes its batch in place. Eager changes the caller's tensor;
a replay changes only its static copy. Overfitting one batch (the same tensor every step)
then trains on different data."""
import torch
from torch import nn
import replaykit as rk


def loss_fn(m, x, y):
    x.mul_(0.5)  # in-place preprocessing of the batch
    return nn.functional.cross_entropy(m(x), y)


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay)
    x, y = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3, 0, 1])
    losses = [step(x, y) for _ in range(5)]  # overfit one batch
    return model, x, losses, step


(m0, x0, l0, _), (m1, x1, l1, step) = run(False), run(True)
same = torch.equal(x0, x1) and all(torch.equal(a, b) for a, b in zip(l0, l1)) and torch.equal(m0[0].weight, m1[0].weight)
print("equal:", same, "| journal reasons:", dict(step.eager_reasons), step.retire_reason)
assert same, "SILENT: input mutation not seen by the caller under replay"
