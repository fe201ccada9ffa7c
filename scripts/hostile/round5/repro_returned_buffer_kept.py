"""Round 5 SILENT: a forward that returns one of its own buffers or parameters (a VQ-VAE's EMA
codebook for logging, CLIP's ``logit_scale``), and the caller keeps it.

Eager hands back the buffer itself: a kept reference follows every later update. Under
``rk.capture`` the recording call's output shares the buffer's storage only until the next call
moves kept outputs to memory of their own, so the reference kept from call 1 freezes there (the
next calls run eagerly, ``live_alias``, and return the buffer itself). Prints SILENT or equal.

    python scripts/hostile/round5/repro_returned_buffer_kept.py
"""

from __future__ import annotations

import torch
from torch import nn

import replaykit as rk


class Net(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("book", torch.zeros(4))

    def forward(self, x):
        y = self.fc(x)
        if self.what == "buffer":  # an EMA statistic updated in forward, returned for logging
            with torch.no_grad():
                self.book.mul_(0.9).add_(y.mean(0), alpha=0.1)
            return y, self.book
        return y, self.scale  # a parameter the loss uses outside (CLIP's logit scale)


def run(replay: bool, what: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = Net(what)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    kept = []
    with rk.capture(m, backend="emulated") if replay else torch.enable_grad():
        for _ in range(5):
            y, extra = m(torch.randn(8, 4))
            (y * extra).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            kept.append(extra)  # eager: every entry is the live buffer / parameter
    return [k.detach().clone() for k in kept]


if __name__ == "__main__":
    for what in ("buffer", "parameter"):
        a, b = run(False, what), run(True, what)
        same = [torch.equal(p, q) for p, q in zip(a, b, strict=True)]
        print(f"{what:9s} {'equal' if all(same) else 'SILENT'} per kept call: {same}")
