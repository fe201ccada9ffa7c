"""Review7 #2-#4 on CUDA: a forward's module-level tensor (added to in place, on the GPU and on the
CPU beside a GPU model), a re-bound one, a global dict; TrainStep and rk.capture against eager.
Prints one row per case: exact (torch.equal of the global and the weights) and the summary."""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.getcwd())  # this checkout's replaykit, not an installed one

import replaykit as rk

TOTAL = torch.zeros(2)
SCALE = torch.tensor(1.0)
STATS = {"calls": 0}
KIND = "total"


class Net(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if KIND == "total":
            with torch.no_grad():
                TOTAL.add_(1.0)
        elif KIND == "dict":
            STATS["calls"] += 1
        return super().forward(x) * SCALE


def train(entry: str, where: str) -> tuple:
    global TOTAL, SCALE
    TOTAL = torch.zeros(2, device=where)
    SCALE = torch.tensor(1.0, device="cuda")
    STATS["calls"] = 0
    torch.manual_seed(0)
    model = Net(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    rec = None
    if entry == "step":
        rec = rk.TrainStep(model, loss, opt, backend="cuda")
    elif entry == "capture":
        rec = rk.capture(model, backend="cuda")
    for i in range(6):
        if KIND == "scale":
            SCALE = torch.tensor(1.0 + i, device="cuda")
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).cuda()
        if entry == "step":
            rec(x)
        else:
            loss(model, x).backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    out = (TOTAL.cpu().clone(), STATS["calls"], model.weight.detach().cpu().clone())
    summary = rec.summary() if rec is not None else ""
    if entry == "capture":
        rec.release()
    return out, summary


def main() -> None:
    global KIND
    warnings.simplefilter("ignore")
    print(f"{'kind':8} {'total on':8} {'entry':8} exact  summary")
    for KIND in ("total", "scale", "dict"):
        for where in ("cuda", "cpu") if KIND == "total" else ("cuda",):
            eager, _ = train("eager", where)
            for entry in ("step", "capture"):
                got, summary = train(entry, where)
                same = (
                    torch.equal(got[0], eager[0])
                    and got[1] == eager[1]
                    and torch.equal(got[2], eager[2])
                )
                print(f"{KIND:8} {where:8} {entry:8} {same!s:6} {summary[:150]}")


if __name__ == "__main__":
    main()
