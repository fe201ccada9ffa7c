"""SILENT: a forward that assigns a module attribute it reads (round-robin over two heads).
A replay runs no Python: the attribute stops toggling and one head trains every step."""
import torch
from torch import nn
import replaykit as rk


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.task = 0

    def forward(self, x):
        h = torch.relu(self.body(x))
        out = self.a(h) if self.task == 0 else self.b(h)
        self.task = 1 - self.task
        return out


def run(replay):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, replay=replay, warmup=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
    return model, step


(m0, _), (m1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
print("equal:", same, "| journal reasons:", dict(step.eager_reasons), step.retire_reason, step.counts)
assert same, "SILENT"
