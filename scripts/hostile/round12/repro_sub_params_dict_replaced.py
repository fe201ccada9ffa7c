import warnings

import torch
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")


class Teacher(nn.Sequential):
    def __init__(self, i, o):
        super().__init__(nn.Linear(i, o))


def run(use_rk):
    torch.manual_seed(0)
    S, T = nn.Linear(4, 4), Teacher(4, 4).requires_grad_(False)
    pass
    opt = torch.optim.SGD(S.parameters(), lr=0.1, fused=True)

    def lf(m, x):
        return (m(x) - T(x)).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend="emulated") if use_rk else None
    for i in range(4):
        if i == 2:
            T[0].__dict__["_parameters"] = {
                "weight": nn.Parameter(T[0].weight * 2, False),
                "bias": T[0].bias,
            }
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        if step:
            step(x)
        else:
            lf(S, x).backward()
            opt.step()
            opt.zero_grad()
    return S.weight.detach().clone(), step


(a, _), (b, step) = run(False), run(True)
print(dict(step.counts), "equal" if torch.equal(a, b) else "SILENT: student weight differs")
