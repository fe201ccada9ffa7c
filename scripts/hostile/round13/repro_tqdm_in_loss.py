"""A site-packages object the step uses (a tqdm bar): loss_fn calls `bar.update(1)` and weights
the loss by `bar.n` (warm-up). TrainStep warns once at construction that it cannot key `bar`
(RecursionError), then replays: bar.n stops advancing and the weight is frozen."""

import io
import sys
import warnings

import torch
from torch import nn
from tqdm import tqdm

import replaykit as rk


def run(use_rk):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
    bar = tqdm(total=100, file=io.StringIO())

    def lf(m, x, y):
        bar.update(1)
        return (1.0 if bar.n < 4 else 0.5) * ((m(x) - y) ** 2).mean()

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk else None
    for x in w:
        print("  warning:", str(x.message)[:110])
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if use_rk:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], bar.n


(pe, ne), (pr, nr) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(pe, pr, strict=False))
print(f"params equal={same}  bar.n eager={ne} replaykit={nr}")
bad = (not same) or ne != nr
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
