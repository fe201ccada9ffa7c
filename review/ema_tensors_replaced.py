"""SILENT: EMA.params (or its weights) replaced by new tensors after recording (an EMA reset);
replays keep lerping into the old tensors, the user's new EMA never moves."""
import torch
from torch import nn
import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), fused=True)
    ema = rk.EMA(model, 0.9)
    step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, ema=ema, replay=replay)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
        if i == 2:
            ema.params = [p.detach().clone() for p in model.parameters()]  # reset the EMA to the weights
    return ema, step


(e0, _), (e1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(e0.params, e1.params))
print("equal:", same, "| journal reasons:", dict(step.eager_reasons), step.retire_reason)
assert same, "SILENT: EMA differs"
