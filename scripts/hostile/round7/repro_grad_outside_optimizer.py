"""The optimizer trains only the head; the encoder still requires grad. The loop zeroes the model's
grads itself before each step (model.zero_grad()), then logs the encoder's gradient norm.
Eager: after each call the encoder's .grad holds this batch's gradient (the optimizer's zero_grad
does not touch it). Replay: None."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1)
    step = rk.TrainStep(
        m, lambda m, x, y: F.cross_entropy(m(x), y), opt, backend="emulated", replay=replay
    )
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(6):
        m.zero_grad(set_to_none=True)
        step(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        seen.append(None if m[0].weight.grad is None else m[0].weight.grad.clone())
    return seen, step.counts["replay"]


e, _ = run(False)
r, n = run(True)
ok = all(
    (p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
    for p, q in zip(e, r, strict=False)
)
print(
    "replays:",
    n,
    "| encoder grad None: eager",
    [p is None for p in e],
    "replay",
    [q is None for q in r],
)
print("SAME" if ok else "DIFF")
