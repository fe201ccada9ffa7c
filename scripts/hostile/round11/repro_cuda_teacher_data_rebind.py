# S8 (CUDA only; the emulated backend replays it exactly): a frozen teacher's weights re-bound through
# .data (also what vector_to_parameters and module.half().float() do) once, midway. argv[1]: backend
import sys

import torch
from _common import compare
from torch import nn

import replaykit as rk

B = sys.argv[1] if len(sys.argv) > 1 else "cuda"
D = "cuda" if B == "cuda" else "cpu"


def body(use_rk):
    torch.manual_seed(0)
    S, T = nn.Linear(6, 3).to(D), nn.Linear(6, 3).to(D).requires_grad_(False)
    opt = torch.optim.SGD(S.parameters(), lr=0.1)

    def lf(m, x):
        return (m(x) - T(x)).pow(2).mean()

    step = rk.TrainStep(S, lf, opt, backend=B) if use_rk else None
    losses = []
    for i in range(6):
        if i == 3:
            for p in T.parameters():
                p.data = p.data * 0.9
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).to(D)
        if step:
            loss = step(x)
        else:
            loss = lf(S, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"out": {"weight": S.weight.detach(), "losses": torch.stack(losses)}, "entry": step}


if D == "cuda":
    rk.enable_determinism()
compare(body)
