# S7: the model's teacher dict is cleared (old teacher freed) and a new teacher built: it takes the
# freed module's id, the dict's polled key (module by id) is unchanged, the new teacher is never read
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
    m = Student(nn.Linear(6, 3).requires_grad_(False))
    opt = torch.optim.SGD(m.fc.parameters(), lr=0.1)
    rec = rk.capture(m, backend="emulated", warmup=1) if use_rk else None
    losses = []
    for i in range(6):
        if i == 2:
            old = id(m.held["teacher"])
            m.held.clear()  # free the old teacher before loading the next
            m.held["teacher"] = nn.Linear(6, 3).requires_grad_(False)
            print("same id:", id(m.held["teacher"]) == old)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"out": {"weight": m.fc.weight.detach(), "losses": torch.stack(losses)}, "entry": rec}


compare(body)
