"""Minimal repro (finding S3): a parameter read more than once inside a captured forward (tied
weights) and read again outside it (an L2 term in the loss) ends with other bits than eager.

Eager's engine sums the three gradient contributions into the weight's AccumulateGrad in its node
order ((l2 + head) + embedding: the loss's nodes run first, then the forward's, latest first); a
replay hands autograd one gradient for the two inner reads, summed inside the graph, so the sum
is l2 + (head + embedding). Float addition is not associative: ulps differ, silently (the shadow
check compares the module's own gradients only, without the outside term).

    python scripts/hostile/single/repro_shared_param_outside.py   # prints DIFF on the base tree
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this tree's replaykit

import torch
from torch import nn

import replaykit as rk


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.out = nn.Linear(12, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))


def run(replay: bool, outside: bool) -> torch.Tensor:
    torch.manual_seed(0)
    m = Tied()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    rec = rk.capture(m, backend="emulated") if replay else None
    for _ in range(6):
        x, y = torch.randint(0, 20, (4, 6), generator=g), torch.randint(0, 20, (4, 6), generator=g)
        loss = nn.functional.cross_entropy(m(x).reshape(-1, 20), y.reshape(-1))
        if outside:
            loss = loss + 1e-3 * m.emb.weight.pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if rec is not None:
        print("   counts", {k: v for k, v in rec.counts.items() if v})
        rec.release()
    return m.emb.weight.detach().clone()


if __name__ == "__main__":
    warnings.simplefilter("ignore", rk.ReplayWarning)
    for outside in (False, True):
        same = torch.equal(run(False, outside), run(True, outside))
        print(f"L2 term outside the forward: {outside}: {'SAME' if same else 'DIFF'}")
