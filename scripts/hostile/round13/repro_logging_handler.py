"""loss_fn logs through `logging` to a handler that keeps the records (a metrics sink): replays
run no Python, so the sink stops receiving records (documented: "never at a replay"). The only
warning says TrainStep cannot key the closure variable `log` (RecursionError) -- not that records stop."""

import logging
import sys
import warnings

import torch
from torch import nn

import replaykit as rk


class Sink(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def run(use_rk):
    log = logging.getLogger("r13")
    sink = Sink()
    log.handlers[:] = [sink]
    log.setLevel(logging.INFO)
    log.propagate = False
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x, y):
        log.info("batch of %d", x.shape[0])
        return ((m(x) - y) ** 2).mean()

    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk else None
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if use_rk:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return len(sink.records)


with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    e, r = run(False), run(True)
print(*[f"  warning: {str(x.message)[:100]}" for x in w], sep="\n")
print(f"records eager={e} replaykit={r}")
print("SILENT" if e != r else "ok")
sys.exit(1 if e != r else 0)
