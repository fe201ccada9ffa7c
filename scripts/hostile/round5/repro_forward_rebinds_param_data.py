"""Round 5 SILENT: a forward that moves a submodule's weights itself (MoCo/BYOL's momentum
encoder, updated inside ``forward`` under ``no_grad``): the recording call runs the forward more
than once and each run applies the update again; the recording's check then finds "eager is not
repeatable" and routes every later call eagerly (``diverged``), but the momentum weights already
moved two or three times at call 1. Prints one line per way of writing the update.

    python scripts/hostile/round5/repro_forward_rebinds_param_data.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class Momentum(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = nn.Linear(4, 4)
        self.k = copy.deepcopy(self.q).requires_grad_(False)

    def forward(self, x):
        q = F.normalize(self.q(x), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters(), strict=True):
                if self.how == "data_rebind":  # MoCo's reference code
                    pk.data = pk.data * 0.9 + pq.data * 0.1
                elif self.how == "inplace":
                    pk.mul_(0.9).add_(pq, alpha=0.1)
                else:
                    pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
            k = F.normalize(self.k(x), dim=1)
        return (q * k).sum(1)


def run(replay: bool, how: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = Momentum(how)
    opt = torch.optim.SGD(m.q.parameters(), lr=0.1)
    out = []
    with rk.capture(m, backend="emulated") if replay else torch.enable_grad() as rec:
        for _ in range(4):
            loss = m(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        if replay:
            print("   ", rec.summary())
    return out + [p.detach().clone() for p in m.parameters()]


if __name__ == "__main__":
    for how in ("data_rebind", "inplace", "data_inplace"):
        a, b = run(False, how), run(True, how)
        ok = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        print(f"{how:13s} {'equal' if ok else 'SILENT'}")
