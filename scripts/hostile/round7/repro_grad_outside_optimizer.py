"""The optimizer trains only the head; the encoder still requires grad. The loop zeroes the model's
grads itself (model.zero_grad()) and logs the encoder's gradient after each step. Eager: this
batch's gradient (the optimizer's zero_grad does not touch it). Replay: None."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1)
    lf = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = rk.TrainStep(m, lf, opt, backend="emulated", replay=replay)
    g, seen = torch.Generator().manual_seed(1), []
    for _ in range(6):
        m.zero_grad(set_to_none=True)
        step(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        seen.append(None if m[0].weight.grad is None else m[0].weight.grad.clone())
    return seen, step.counts["replay"]


(e, _), (r, n) = run(False), run(True)
print("replays:", n, "| grad None: eager", [p is None for p in e], "replay", [q is None for q in r])
same = all(
    (p is None) == (q is None) and (p is None or torch.equal(p, q))
    for p, q in zip(e, r, strict=False)
)
print("SAME" if same else "DIFF")
