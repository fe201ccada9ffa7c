"""SILENT: with accumulate=2, a gradient kept between micro-batches as p.grad.detach(), .data or a
view is overwritten by the next step's first micro-batch (copy-out only sees the alias object)."""
import torch
from torch import nn
import replaykit as rk


def run(replay, keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, accumulate=2, replay=replay)
    g = torch.Generator().manual_seed(1)
    kept = []
    for i in range(8):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
        if i % 2 == 0:
            kept.append(keep(model[0].weight.grad))  # logged later, e.g. a gradient-norm history
    return kept, step


for name, keep in [("detach", lambda t: t.detach()), ("data", lambda t: t.data), ("view", lambda t: t.view(-1))]:
    (k0, _), (k1, step) = run(False, keep), run(True, keep)
    same = all(torch.equal(a, b) for a, b in zip(k0, k1))
    print(f"{name}: equal={same} journal={dict(step.eager_reasons)} copy_out={step.counts['copy_out']}")
    assert same, f"SILENT ({name})"
