"""CRASH: TrainStep with a disabled GradScaler (GradScaler(enabled=False), or the CUDA one on a
machine without CUDA) fails on the first replayed call with AttributeError: '_growth_factor'."""
import torch
from torch import nn
import replaykit as rk

model = nn.Sequential(nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", enabled=False)
step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, scaler=scaler)
for _ in range(3):
    step(torch.randn(6, 8), torch.randint(0, 4, (6,)))
print(step.counts)
