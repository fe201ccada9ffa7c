"""Two TrainSteps share an encoder; B's optimizer trains only B's head (a probe), so B's call leaves
the encoder's .grad set and A's next step adds to it. As found, B's replay left it None; since
6b460fc A's replay reads a stale copy of the gradient B handed out (the encoder drifts)."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    enc = nn.Linear(8, 8)
    a, b = (nn.Sequential(enc, nn.Tanh(), nn.Linear(8, k)) for k in (4, 2))
    lf = lambda m, x, y: F.cross_entropy(m(x), y % m[2].out_features)  # noqa: E731
    kw = dict(backend="emulated", replay=replay)
    sa = rk.TrainStep(a, lf, torch.optim.SGD(a.parameters(), lr=0.1), **kw)
    sb = rk.TrainStep(b, lf, torch.optim.SGD(b[2].parameters(), lr=0.1), **kw)
    g, out = torch.Generator().manual_seed(1), []
    for i in range(12):
        (sa if i % 2 == 0 else sb)(
            torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        )
        out.append(enc.weight.detach().clone())
        out.append(None if enc.weight.grad is None else enc.weight.grad.clone())
    return out, sb.counts["replay"]


(e, _), (r, n) = run(False), run(True)
eq = [
    (p is None) == (q is None) and (p is None or torch.equal(p, q))
    for p, q in zip(e, r, strict=False)
]
print(
    "B replays:",
    n,
    "| (weight, grad) after each call equal:",
    list(zip(eq[::2], eq[1::2], strict=False)),
)
print("SAME" if all(eq) else "DIFF")
