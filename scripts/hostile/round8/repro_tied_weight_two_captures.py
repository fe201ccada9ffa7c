"""One parameter used by two separately captured modules (tied weight): replay vs eager."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(use_rk):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 8) * 0.3)

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = w, nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.b(x) + x @ self.w.t() @ self.w)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, h):
            return h @ self.w.t()

    enc, head = Enc(), Head()
    if use_rk:
        (
            rk.capture(enc, backend="emulated", warmup=1),
            rk.capture(head, backend="emulated", warmup=1),
        )
    o = torch.optim.SGD([w, *enc.b.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        o.zero_grad()
        F.cross_entropy(head(enc(x)), y).backward()
        seen.append(w.grad.clone())
        o.step()
    return seen


e, r = run(False), run(True)
print(
    "SAME" if all(torch.equal(a, b) for a, b in zip(e, r, strict=False)) else "DIFF",
    [torch.equal(a, b) for a, b in zip(e, r, strict=False)],
)
