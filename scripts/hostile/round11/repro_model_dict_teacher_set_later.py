# S6: the model's teacher dict gets a new teacher after rk.capture started; that teacher is then reloaded
import torch
from _common import compare
from torch import nn

import replaykit as rk


class Student(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.held = {"teacher": t}

    def forward(self, x):
        return self.fc(x) - self.held["teacher"](x)


def body(use_rk):
    torch.manual_seed(0)
    T, T2 = nn.Linear(6, 3).requires_grad_(False), nn.Linear(6, 3).requires_grad_(False)
    m = Student(T)
    opt = torch.optim.SGD(m.fc.parameters(), lr=0.1)
    rec = rk.capture(m, backend="emulated", warmup=1) if use_rk else None
    losses = []
    for i in range(6):
        if i == 1:
            m.held["teacher"] = T2  # a new epoch's teacher: records anew (correct)
        if i == 3:
            T2.load_state_dict({k: v * 0.9 for k, v in T2.state_dict().items()}, assign=True)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"out": {"weight": m.fc.weight.detach(), "losses": torch.stack(losses)}, "entry": rec}


compare(body)
