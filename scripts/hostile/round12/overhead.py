"""Per-call cost of keying a big outside teacher (k Identity submodules: no compute in a replay)."""

import time
import warnings

import torch
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")

for k in (1, 100, 400):
    torch.manual_seed(0)
    S = nn.Linear(6, 3)
    T = nn.Sequential(
        nn.Linear(6, 3), *[nn.Sequential(nn.Identity(), nn.Identity()) for _ in range(k)]
    ).requires_grad_(False)
    for j, m in enumerate(T.modules()):
        m.note = {"j": j}  # a mutable plain value per submodule: polled every call
    opt = torch.optim.SGD(S.parameters(), lr=0.1, fused=True)

    def lf(m, x, T=T):
        return (m(x) - T(x)).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend="emulated")
    x = torch.randn(5, 6)
    for _ in range(5):
        step(x)
    t = time.perf_counter()
    n = 50
    for _ in range(n):
        step(x)
    rep = (time.perf_counter() - t) / n * 1e3
    t = time.perf_counter()
    for _ in range(n):
        lf(S, x).backward()
        opt.step()
        opt.zero_grad()
    eag = (time.perf_counter() - t) / n * 1e3
    print(
        f"k={k:4d} submodules={2 * k + 2:4d} replay {rep:7.2f} ms/call  eager {eag:7.2f} ms/call  counts={ {a: b for a, b in step.counts.items() if b} }"
    )
