"""Python state of a torch object the step reads is keyed by the object's identity only.
(1) TrainStep: aux-loss warm-up from `sched.last_epoch` (the loop steps the scheduler);
(2) TrainStep: noise from a `torch.distributions.Normal` whose `.scale` the loop re-binds at step 3;
(3) rk.capture: the forward reads `self.sched.last_epoch` of the scheduler the model holds."""

import sys

import torch
from torch import nn

import replaykit as rk


class Net(nn.Sequential):
    sched = None

    def forward(self, x):
        out = super().forward(x)
        return out if self.sched is None else out * min(1.0, 0.25 * (1 + self.sched.last_epoch))


def run(case, use_rk):
    torch.manual_seed(0)
    m = Net(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    noise = torch.distributions.Normal(torch.tensor(0.0), torch.tensor(0.1))

    def lf(m, x, y):
        if case == "noise":
            x = x + noise.sample(x.shape)
        out = m(x)
        w = min(1.0, sched.last_epoch / 3) if case == "sched" else 0.0
        return ((out - y) ** 2).mean() + w * out.pow(2).mean()

    if case == "capture":
        m.sched = sched
    step = rk.TrainStep(m, lf, opt, backend="emulated") if use_rk and case != "capture" else None
    if use_rk and case == "capture":
        rk.capture(m, backend="emulated")
    for i in range(6):
        sched.step() if i else None
        if i == 3:
            noise.scale = torch.tensor(0.5)
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if step is not None:
            step(x, y)
        else:
            lf(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


bad = False
for case in ("sched", "noise", "capture"):
    same = all(torch.equal(a, b) for a, b in zip(run(case, False), run(case, True), strict=False))
    print(f"{case}: params equal={same}")
    bad |= not same
print("SILENT" if bad else "ok")
sys.exit(1 if bad else 0)
