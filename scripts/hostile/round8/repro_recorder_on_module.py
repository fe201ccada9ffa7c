"""`model.rec = rk.capture(model)`: the recorder kept on the module it captures. Exact, but the
recorder retires at its first recording with 'capture failed: RecursionError' (never replays)."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(use_rk):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if use_rk:
        model.rec = rk.capture(model, backend="emulated", warmup=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        seen.append(model[0].weight.detach().clone())
    return seen, getattr(model, "rec", None)


e, _ = run(False)
r, rec = run(True)
print("SAME" if all(torch.equal(a, b) for a, b in zip(e, r, strict=True)) else "DIFF")
print("replays:", rec.counts["replay"], "| retired:", rec.retire_reason)
