"""TrainStep with a float lr that a scheduler changes every step (documented: the optimizer step
then leaves the graph and runs eagerly). loss_fn reads the lr too (a penalty annealed with the
schedule, `opt.param_groups[0]["lr"]` or `sched.get_last_lr()[0]`): once the optimizer step left
the graph the forward+backward recording keeps replaying with a stale lr. No warning."""

import sys
import warnings

import torch
from torch import nn

import replaykit as rk


def run(use_rk):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)

    def lf(m, x, y):
        out = m(x)
        return ((out - y) ** 2).mean() + opt.param_groups[0]["lr"] * out.pow(2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk else None
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if use_rk:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
        sched.step()
    if use_rk:
        print(" ", step.counts, "| optimizer_eager:", step.optimizer_eager[:60])
    return [p.detach().clone() for p in m.parameters()]


warnings.simplefilter("ignore")
same = all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=False))
print(f"params equal={same}")
print("SILENT" if not same else "ok")
sys.exit(0 if same else 1)
