"""Two TrainSteps share an encoder; B's optimizer trains only B's head (a probe), so after B's
call eager leaves the encoder's .grad set (it is not B's to zero). B's replay leaves it None."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    enc = nn.Linear(8, 8)
    a, b = (
        nn.Sequential(enc, nn.Tanh(), nn.Linear(8, 4)),
        nn.Sequential(enc, nn.Tanh(), nn.Linear(8, 2)),
    )
    lf = lambda m, x, y: F.cross_entropy(m(x), y % m[2].out_features)  # noqa: E731
    sa = rk.TrainStep(
        a, lf, torch.optim.SGD(a.parameters(), lr=0.1), backend="emulated", replay=replay
    )
    sb = rk.TrainStep(
        b, lf, torch.optim.SGD(b[2].parameters(), lr=0.1), backend="emulated", replay=replay
    )
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(8):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        (sa if i % 2 == 0 else sb)(x, y)
        out.append(None if enc.weight.grad is None else enc.weight.grad.clone())
    return out, (sa.counts["replay"], sb.counts["replay"])


e, _ = run(False)
r, n = run(True)
ok = all(
    (p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
    for p, q in zip(e, r, strict=False)
)
print(
    "replays (a, b):",
    n,
    "| enc.weight.grad None after call: eager",
    [p is None for p in e],
    "replay",
    [q is None for q in r],
)
print("SAME" if ok else "DIFF")
