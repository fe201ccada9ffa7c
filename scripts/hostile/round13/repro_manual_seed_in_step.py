"""Reseeding torch's generator inside the recorded code. The recording call's runs all execute the
reseed, so its check agrees; a replay runs no Python, so it draws dropout/noise from wherever the
generator is, while eager reseeds every call. (1) TrainStep: `torch.manual_seed(1234)` in loss_fn;
(2) TrainStep: `with torch.random.fork_rng(): torch.manual_seed(0); noise = randn_like(x)`;
(3) rk.capture: `torch.manual_seed(7)` in forward, the loop seeded 7 just before."""

import sys

import torch
from torch import nn

import replaykit as rk


def lf_seed(m, x, y):
    torch.manual_seed(1234)
    return ((m(x) - y) ** 2).mean()


def lf_fork(m, x, y):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        noise = 0.1 * torch.randn_like(x)
    return ((m(x + noise) - y) ** 2).mean()


class Seeded(nn.Sequential):
    def forward(self, x):
        torch.manual_seed(7)
        return super().forward(x)


def run(case, use_rk):
    torch.manual_seed(0)
    m = Seeded(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
    lf = {"seed": lf_seed, "fork": lf_fork}.get(case, lambda m, x, y: ((m(x) - y) ** 2).mean())
    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and case != "capture" else None
    if use_rk and case == "capture":
        rk.capture(m, backend="emulated")
    torch.manual_seed(7)
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


bad = False
for case in ("seed", "fork", "capture"):
    same = all(torch.equal(a, b) for a, b in zip(run(case, False), run(case, True), strict=False))
    print(f"{case}: params equal={same}")
    bad |= not same
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
