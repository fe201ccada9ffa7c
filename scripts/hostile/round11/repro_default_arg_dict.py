# S1: a teacher in a dict held by loss_fn's default argument (three containers down), reloaded as new tensors
import torch
from _common import compare
from torch import nn

import replaykit as rk


def body(use_rk):
    torch.manual_seed(0)
    S, T = nn.Linear(6, 3), nn.Linear(6, 3).requires_grad_(False)
    opt = torch.optim.SGD(S.parameters(), lr=0.1)

    def lf(m, x, models=None):
        if models is None:
            models = {"teacher": T}
        return (m(x) - models["teacher"](x)).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend="emulated") if use_rk else None
    losses = []
    for i in range(6):
        if i == 2:
            T.load_state_dict({k: v * 0.9 for k, v in T.state_dict().items()}, assign=True)
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
