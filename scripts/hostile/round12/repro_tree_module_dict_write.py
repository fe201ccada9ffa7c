import warnings

import torch
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")


class M(nn.Module):  # a registered submodule's plain attribute written through __dict__
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.k = 1.0

    def forward(self, x):
        return self.lin(x) * self.lin.k


def run(use_rk):
    torch.manual_seed(0)
    S = M()
    opt = torch.optim.SGD(S.parameters(), lr=0.1, fused=True)

    def lf(m, x):
        return m(x).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend="emulated") if use_rk else None
    for i in range(4):
        if i == 2:
            S.lin.__dict__["k"] = 2.0  # or object.__setattr__(S.lin, "k", 2.0)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        if step:
            step(x)
        else:
            lf(S, x).backward()
            opt.step()
            opt.zero_grad()
    return S.lin.weight.detach().clone(), step


(a, _), (b, step) = run(False), run(True)
print(dict(step.counts), "equal" if torch.equal(a, b) else "SILENT: weight differs")
