"""The step writes into a Python container the caller passes as an argument.
TrainStep: loss_fn fills a fresh dict per call (`out["loss"] = loss.detach()`): a replay leaves it
empty. rk.capture: forward appends to a list argument (`sink.append(...)`): the recording call
appends more than once / replays never; forward sets `feats["h"] = h` in a dict argument: the
caller's dict is never filled."""

import sys
import warnings

import torch
from torch import nn

import replaykit as rk


class Net(nn.Sequential):
    def forward(self, x, box):
        out = super().forward(x)
        if isinstance(box, list):
            box.append(out.detach().sum())
        else:
            box["h"] = out
        return out


def run(case, use_rk):
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y, out):
        loss = ((m(x, []) - y) ** 2).mean()
        out["loss"] = loss.detach()
        return loss

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and case == "step" else None
    if use_rk and case != "step":
        rk.capture(m, backend="emulated")
    seen, sink = [], []
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x, y, box = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g), {}
        if step is not None or case == "step":
            step(x, y, box) if step is not None else lf(m, x, y, box).backward()
        else:
            ((m(x, sink if case == "list" else box) - y) ** 2).mean().backward()
        if step is None:
            opt.step()
            opt.zero_grad()
        seen.append(sorted(box))
    return seen, len(sink)


warnings.simplefilter("ignore")  # a retirement warns now: the exit code says equal or not
bad = False
for case in ("step", "list", "dict"):
    e, r = run(case, False), run(case, True)
    print(f"{case}: eager {e}\n{'':{len(case)}}  rk    {r}")
    bad |= e != r
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
