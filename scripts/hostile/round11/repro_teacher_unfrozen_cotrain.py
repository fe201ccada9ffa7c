# S4: the teacher is unfrozen midway and trained on the gradients the student's step leaves on it
import torch
from _common import compare
from torch import nn

import replaykit as rk


def body(use_rk):
    torch.manual_seed(0)
    S, T = nn.Linear(6, 3), nn.Linear(6, 3).requires_grad_(False)
    opt, t_opt = torch.optim.SGD(S.parameters(), lr=0.1), torch.optim.SGD(T.parameters(), lr=0.1)

    def lf(m, x):
        return (m(x) - T(x)).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend="emulated") if use_rk else None
    for i in range(6):
        if i == 3:
            T.requires_grad_(True)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        if step:
            step(x)
        else:
            loss = lf(S, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_opt.step()
        t_opt.zero_grad()
    return {"out": {"student": S.weight.detach(), "teacher": T.weight.detach()}, "entry": step}


compare(body)
