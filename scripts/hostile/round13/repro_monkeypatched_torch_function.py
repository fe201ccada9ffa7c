"""A torch function the forward calls is monkey-patched by the script mid-run (a "speed patch":
`nn.functional.gelu = partial(gelu, approximate="tanh")`). Both entry points keep replaying the
old op (documented: torch's modules are not walked; no warning)."""

import functools
import sys
import warnings

import torch
from torch import nn

import replaykit as rk

GELU = nn.functional.gelu


class Net(nn.Sequential):
    def forward(self, x):
        return self[1](nn.functional.gelu(self[0](x)))


def run(entry, use_rk):
    nn.functional.gelu = GELU
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        return ((m(x) - y) ** 2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and entry == "step" else None
    if use_rk and entry == "capture":
        rk.capture(m, backend="emulated")
    for i in range(6):
        if i == 3:
            nn.functional.gelu = functools.partial(GELU, approximate="tanh")
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    nn.functional.gelu = GELU
    return [p.detach().clone() for p in m.parameters()]


warnings.simplefilter("error")
bad = False
for entry in ("step", "capture"):
    same = all(torch.equal(a, b) for a, b in zip(run(entry, False), run(entry, True), strict=False))
    print(f"{entry}: params equal={same}")
    bad |= not same
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
