"""Not bitwise although journaled (retire 'capture failed'): a capture that fails at .item() has
already run the forward's Python; the twin's body then runs it again, so an attribute the
forward assigns (a round-robin flag) moves twice on that call and the wrong head trains.
(Python state outside the model - a closure counter, a log list - still runs twice: see
capture_failure_reruns_closure_python.py, not fixed.)"""
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


def loss_fn(m, x, y):
    loss = nn.functional.cross_entropy(m(x), y)
    return loss * (2.0 if loss.item() > 100 else 1.0)  # a host read: the capture fails here


def run(replay):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay, warmup=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
    return model, step


(m0, _), (m1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
print("equal:", same, "| retire:", step.retire_reason)
assert same, "differs although journaled"
