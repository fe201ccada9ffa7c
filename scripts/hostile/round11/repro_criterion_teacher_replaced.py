# S2: a KD criterion module (loss_fn) whose teacher slot gets a copy of the student each "epoch"
import copy

import torch
from _common import compare
from torch import nn

import replaykit as rk


class KD(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.teacher = t

    def forward(self, m, x):
        return (m(x) - self.teacher(x)).pow(2).mean()


def body(use_rk):
    torch.manual_seed(0)
    S, kd = nn.Linear(6, 3), KD(nn.Linear(6, 3).requires_grad_(False))
    opt = torch.optim.SGD(S.parameters(), lr=0.1)
    step = rk.TrainStep(S, kd, opt, backend="emulated") if use_rk else None
    losses = []
    for i in range(6):
        if i == 2:
            kd.teacher = copy.deepcopy(S).requires_grad_(False)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        if step:
            loss = step(x)
        else:
            loss = kd(S, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"out": {"weight": S.weight.detach(), "losses": torch.stack(losses)}, "entry": step}


compare(body)
