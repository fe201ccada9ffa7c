"""SILENT: a loss_fn that flips a value in a dict the model holds (two values in turn); both get
recorded, then replays run no Python and the flip stops."""
import torch
from torch import nn
import replaykit as rk


def loss_fn(m, x, y):
    m.state["task"] = 1 - m.state.get("task", 0)
    return nn.functional.cross_entropy(m(x), y) * (1.0 + m.state["task"])


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    model.state = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay, warmup=2)
    g = torch.Generator().manual_seed(1)
    losses = [step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(8)]
    return losses, step


(l0, _), (l1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(l0, l1))
print("equal:", same, "| journal:", dict(step.eager_reasons), step.retire_reason)
assert same, "SILENT"
