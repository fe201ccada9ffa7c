"""SILENT: an input that requires grad (saliency, adversarial training) gets x.grad in eager;
under replay the static copy does not require grad and x.grad stays None."""
import torch
from torch import nn
import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, replay=replay)
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(4):
        x = torch.randn(6, 8, generator=g).requires_grad_(True)
        step(x, torch.randint(0, 4, (6,), generator=g))
        grads.append(x.grad)
    return grads, step


(g0, _), (g1, step) = run(False), run(True)
print("eager x.grad None:", [g is None for g in g0], "replay:", [g is None for g in g1])
print("journal reasons:", dict(step.eager_reasons), step.retire_reason)
assert all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(g0, g1)), "SILENT"
