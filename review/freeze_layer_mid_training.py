"""SILENT: requires_grad_(False) on a layer after recording; the replay still updates it.

Eager: the frozen layer gets no .grad, so SGD leaves it (and its momentum) alone.
Replay: the recording computes and applies its gradient; the journal says nothing.
"""
import torch
from torch import nn
import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, replay=replay)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
        if i == 2:
            model[0].requires_grad_(False)  # fine-tuning: freeze the first layer
    return model, step


(m0, _), (m1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
print("equal:", same, "| journal reasons:", dict(step.eager_reasons), step.retire_reason)
assert same, "SILENT: frozen layer kept training under replay"
