"""Was SILENT: a module's own host RNG (``random.Random`` / ``np.random.default_rng``) drawn in forward.

Every call ended eager (retired / ``diverged``), yet the results differed from eager's: the
recording call runs the forward more than once (probe, record, check) and each run drew from the
private generator, which nothing put back. Fixed: the call state finds such generators, puts them
back, and a draw from one retires the entry point naming it (``verify/host_generators.py``);
every line prints "equal".

    PYTHONPATH=$PWD python scripts/hostile/round4/repro_private_host_rng.py
"""

import random

import numpy as np
import torch
import torch.nn.functional as F

import replaykit as rk


class MaskedAE(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.rng = random.Random(7) if kind == "random.Random" else np.random.default_rng(7)

    def forward(self, x):
        draws = [self.rng.random() for _ in range(8)]
        mask = torch.tensor([float(d > 0.3) for d in draws])
        return self.dec(F.relu(self.enc(x * mask)))


def run(mode, kind):
    torch.manual_seed(0)
    m = MaskedAE(kind)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, fused=True)
    loss_fn = lambda mm, x: F.mse_loss(mm(x), x)  # noqa: E731
    step = rk.TrainStep(m, loss_fn, opt, backend="emulated") if mode == "step" else None
    xs, out = [torch.randn(4, 8) for _ in range(4)], []
    with rk.capture(m, backend="emulated") if mode == "capture" else torch.enable_grad() as rec:
        for x in xs:
            if step is not None:
                out.append(step(x))
                continue
            loss = loss_fn(m, x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        entry = step or rec
        return out, (entry.summary() if entry is not None else "")


for kind in ("random.Random", "np.default_rng"):
    ref, _ = run("eager", kind)
    for mode in ("capture", "step"):
        got, summary = run(mode, kind)
        bad = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if not torch.equal(a, b)]
        print(f"{kind:15s} {mode:8s}: " + (f"SILENT loss differs from call {bad[0]}: "
              f"{ref[bad[0]].item():.6f} vs {got[bad[0]].item():.6f}" if bad else "equal") + f"  [{summary[:90]}]")  # fmt: skip


def loss_side(replay: bool) -> list[torch.Tensor]:
    """The same through TrainStep's loss_fn: a task choice from a closure's random.Random."""
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, fused=True)
    rng = random.Random(0)

    def loss_fn(mm, x):
        out = mm(x)
        return out.pow(2).mean() if rng.random() < 0.5 else out.abs().mean()

    step = rk.TrainStep(m, loss_fn, opt, backend="emulated", replay=replay)
    return [step(torch.randn(4, 8)) for _ in range(5)]


a, b = loss_side(False), loss_side(True)
bad = [i for i, (u, v) in enumerate(zip(a, b, strict=True)) if not torch.equal(u, v)]
print("loss closure Random step: " + (f"SILENT from call {bad[0]}" if bad else "equal"))
