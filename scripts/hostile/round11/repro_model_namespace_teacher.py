# S5: the model keeps its teacher in a SimpleNamespace (not a dict/list/tuple); rk.capture
import types

import torch
from _common import compare
from torch import nn

import replaykit as rk


class Student(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.aux = types.SimpleNamespace(teacher=t)

    def forward(self, x):
        return self.fc(x) - self.aux.teacher(x)


def body(use_rk):
    torch.manual_seed(0)
    T = nn.Linear(6, 3).requires_grad_(False)
    m = Student(T)
    opt = torch.optim.SGD(m.fc.parameters(), lr=0.1)
    rec = rk.capture(m, backend="emulated", warmup=1) if use_rk else None
    losses = []
    for i in range(6):
        if i == 2:
            T.load_state_dict({k: v * 0.9 for k, v in T.state_dict().items()}, assign=True)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"out": {"weight": m.fc.weight.detach(), "losses": torch.stack(losses)}, "entry": rec}


compare(body)
