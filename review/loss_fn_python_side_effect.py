"""NOT FIXED (design): loss_fn's Python runs only on eager and recording calls. A loss_fn that
logs into a list outside the model (log.append(loss.detach())) gets one entry per recording,
and that entry is the recording's static tensor, rewritten by every replay."""
import torch
from torch import nn
import replaykit as rk

log = []


def loss_fn(m, x, y):
    loss = nn.functional.cross_entropy(m(x), y)
    log.append(loss.detach())
    return loss


def run(replay):
    log.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
    return list(log), step


(k0, _), (k1, step) = run(False), run(True)
print("entries: eager", len(k0), "replay", len(k1), "| journal:", dict(step.eager_reasons))
same = len(k0) == len(k1) and all(torch.equal(a, b) for a, b in zip(k0, k1))
assert same, "SILENT (design limit)"
