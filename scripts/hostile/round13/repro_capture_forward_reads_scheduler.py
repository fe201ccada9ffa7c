"""SILENT: rk.capture; the model keeps its LR scheduler as a plain attribute and its forward
scales the logits by a ramp read from `self.sched.last_epoch`. The module guard keys a torch
object (LRScheduler) by identity, so replays keep the recorded ramp. Exits 1 on a difference."""

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        ramp = min(1.0, self.sched.last_epoch / 4)  # warm a logit temperature up with the schedule
        return self.b(self.a(x).relu()) * (1.0 + ramp)


def train(use_rk):
    torch.manual_seed(0)
    M = Net()
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)
    M.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if use_rk:
        rk.capture(M, backend="emulated")
    hist = []
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = F.cross_entropy(M(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        M.sched.step()
        hist.append((loss.detach(), [p.detach().clone() for p in M.parameters()]))
    return hist, (rk.recorder_of(M) if use_rk else None)


eager, _ = train(False)
replayed, rec = train(True)
print(rec.summary())
for i, ((la, pa), (lb, pb)) in enumerate(zip(eager, replayed, strict=False)):
    if not torch.equal(la, lb) or not all(map(torch.equal, pa, pb)):
        print(f"SILENT: step {i}: loss {la.item():.6f} vs {lb.item():.6f}")
        sys.exit(1)
print("equal")
