"""The step appends a line to a log file (`with open(path, "a") as f: f.write(...)`): the recording
call runs the code several times (each appends), a replay never does. TrainStep: loss_fn writes;
rk.capture: forward writes. Lines after 5 steps differ from eager's 5."""

import os
import sys
import tempfile
import warnings

import torch
from torch import nn

import replaykit as rk

PATH = os.path.join(tempfile.mkdtemp(), "log.csv")


def log(tag):
    with open(PATH, "a") as f:
        f.write(tag + "\n")


class Net(nn.Sequential):
    writes = False

    def forward(self, x):
        if self.writes:
            log("forward")
        return super().forward(x)


def run(entry, use_rk):
    open(PATH, "w").close()
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    m.writes = entry == "capture"
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        if entry == "step":
            log("loss")
        return ((m(x) - y) ** 2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and entry == "step" else None
    if use_rk and entry == "capture":
        rk.capture(m, backend="emulated")
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    with open(PATH) as f:
        return f.read().count("\n")


warnings.simplefilter("ignore")  # a retirement warns now: the exit code says equal or not
bad = False
for entry in ("step", "capture"):
    e, r = run(entry, False), run(entry, True)
    print(f"{entry}: lines eager={e} replaykit={r}")
    bad |= e != r
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
