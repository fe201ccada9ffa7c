"""NOT FIXED (design): a capture that fails (here at .item()) has already run loss_fn's Python;
the twin's body then runs it again, so a side effect before the failing op (a closure
counter, a log list) happens twice on that call. Journaled ('capture failed'), not bitwise
in the user's Python state."""
import torch
from torch import nn
import replaykit as rk

seen = []


def loss_fn(m, x, y):
    seen.append(x.shape[0])  # the user's own bookkeeping, before the host read
    loss = nn.functional.cross_entropy(m(x), y)
    return loss * (2.0 if loss.item() > 100 else 1.0)


def run(replay):
    seen.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay)
    for _ in range(4):
        step(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    return len(seen), step


(n0, _), (n1, step) = run(False), run(True)
print("loss_fn Python calls: eager", n0, "replay", n1, "| retire:", step.retire_reason)
assert n0 == n1, "the failed capture's call ran loss_fn's Python twice"
