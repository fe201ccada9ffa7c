"""A weight read twice in a captured module and again outside (tied head): last bits differ. Known:
limits.md "Still silent" `tied_weight_also_read_outside`: (head + r1) + r2 vs head + (r1 + r2)."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class Enc(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w, self.b = w, nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.b(x) + x @ self.w.t() @ self.w)


def run(use_rk):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 8) * 0.3)
    enc, head = Enc(w), nn.Module()
    head.w, head.forward = w, lambda h: h @ head.w.t()
    if use_rk:
        rk.capture(enc, backend="emulated", warmup=1)
    opt, g, seen = torch.optim.SGD([w, *enc.b.parameters()], lr=0.1), torch.Generator(), []
    g.manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(head(enc(x)), y).backward()
        seen.append(w.grad.clone())
        opt.step()
    return seen


e, r = run(False), run(True)
print("SAME" if all(torch.equal(a, b) for a, b in zip(e, r, strict=True)) else "DIFF")
