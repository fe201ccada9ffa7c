# One Tensor.register_hook on the first layer's weight that reads the last layer's .grad.
import torch
import torch.nn as nn

import replaykit as rk


def train(capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    rec = rk.capture(model, backend="emulated", warmup=1) if capture else None
    log = []

    def hook(g):
        log.append(None if model[2].weight.grad is None else model[2].weight.grad.sum().item())
        return g

    model[0].weight.register_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return log, rec


le, _ = train(False)
lc, rec = train(True)
print("eager ", le)
print("replay", lc, rec.counts["replay"], dict(rec.eager_reasons))
