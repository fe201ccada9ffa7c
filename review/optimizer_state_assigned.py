"""SILENT: an optimizer moment reset by assignment (opt.state[p]["exp_avg"] = zeros) after
recording; the old tensor stays alive at its address, so the replay keeps using it."""
import torch
from torch import nn
import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    step = rk.TrainStep(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, replay=replay)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
        if i == 2:
            for p, state in opt.state.items():
                state["exp_avg"] = torch.zeros_like(p)
    return model, step


(m0, _), (m1, step) = run(False), run(True)
same = all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
print("equal:", same, "| journal:", dict(step.eager_reasons), step.retire_reason)
assert same, "SILENT"
