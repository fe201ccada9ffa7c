"""Frozen at the recording, no warning (TrainStep loss_fn and capture forward): `os.environ`, a
`contextvars.ContextVar`, a config dict from an `@functools.lru_cache` getter. Each changes at step 3."""

import contextvars
import functools
import os
import sys
import warnings

import torch
from torch import nn

import replaykit as rk

TEMP = contextvars.ContextVar("temp", default=1.0)


@functools.lru_cache(None)
def cfg():
    return {"temp": 1.0}


def host_value(case):
    return {
        "environ": lambda: float(os.environ["R13_T"]),
        "contextvar": TEMP.get,
        "lru_cache": lambda: cfg()["temp"],
    }[case]()


class Net(nn.Sequential):
    case = None

    def forward(self, x):
        out = super().forward(x)
        return out if self.case is None else out / host_value(self.case)


def run(case, entry, use_rk):
    os.environ["R13_T"] = "1.0"
    TEMP.set(1.0)
    cfg()["temp"] = 1.0
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    m.case = case if entry == "capture" else None
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        return ((m(x) / (host_value(case) if entry == "step" else 1.0) - y) ** 2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and entry == "step" else None
    if use_rk and entry == "capture":
        rk.capture(m, backend="emulated")
    for i in range(6):
        if i == 3:
            os.environ["R13_T"] = "2.0"
            TEMP.set(2.0)
            cfg()["temp"] = 2.0
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


warnings.simplefilter("error")
bad = False
for case in ("environ", "contextvar", "lru_cache"):
    for entry in ("step", "capture"):
        same = all(
            torch.equal(a, b)
            for a, b in zip(run(case, entry, False), run(case, entry, True), strict=False)
        )
        print(f"{case:10s} {entry:8s} params equal={same}")
        bad |= not same
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
