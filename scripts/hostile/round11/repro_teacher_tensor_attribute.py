# S3: a plain (non-buffer) tensor attribute of the teacher re-bound by the loop (a temperature)
import torch
from _common import compare
from torch import nn

import replaykit as rk


def body(use_rk):
    torch.manual_seed(0)
    S, T = nn.Linear(6, 3), nn.Linear(6, 3).requires_grad_(False)
    T.temp = torch.tensor(1.0)
    opt = torch.optim.SGD(S.parameters(), lr=0.1)

    def lf(m, x):
        return (m(x) - T(x) / T.temp).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend="emulated") if use_rk else None
    losses = []
    for i in range(6):
        if i >= 2:
            T.temp = torch.tensor(1.0 + 0.5 * i)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        if step:
            loss = step(x)
        else:
            loss = lf(S, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"out": {"weight": S.weight.detach(), "losses": torch.stack(losses)}, "entry": step}


compare(body)
