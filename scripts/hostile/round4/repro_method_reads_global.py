"""Was SILENT (round 4, cause 1; keyed now, every line prints ``equal``): forward reads a module
global through a method or property, not by name.

``self.own_scale()`` (a method of the model's own class), ``self.cfg.scale()`` (a method of a
held object), ``self.cfg.value`` (a ``@property``) and a module-level helper decorated with
``@torch.no_grad()`` all compute from the global ``EPOCH``, which the
loop advances. Each recording keyed the globals forward's own code names, functions it reaches
through globals/closures, and held objects' plain attributes, but not the code of methods or
properties it calls through ``self``/a held object, nor the function a decorator wraps (its
wrapper's globals are torch's): the replay kept the first value. Both entry points. The code guard
now follows those (``replaykit/guards/code.py``: ``_class_code``, ``__wrapped__``).

    PYTHONPATH=$PWD python scripts/hostile/round4/repro_method_reads_global.py
"""

import torch

import replaykit as rk

EPOCH = 0


class Cfg:
    def scale(self):
        return 1.0 + EPOCH

    @property
    def value(self):
        return 1.0 + EPOCH


@torch.no_grad()
def decorated_scale():
    return 1.0 + EPOCH


class Net(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.cfg, self.how = torch.nn.Linear(4, 2), Cfg(), how

    def own_scale(self):
        return 1.0 + EPOCH

    def forward(self, x):
        s = {"own method": self.own_scale, "held method": self.cfg.scale,
             "held property": lambda: self.cfg.value,
             "no_grad helper": decorated_scale}[self.how]()  # fmt: skip
        return self.fc(x) * s


def run(mode: str, how: str) -> list[torch.Tensor]:
    global EPOCH
    torch.manual_seed(0)
    m = Net(how)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, fused=True)
    loss_fn = lambda mm, x: mm(x).pow(2).mean()  # noqa: E731
    step = rk.TrainStep(m, loss_fn, opt, backend="emulated") if mode == "step" else None
    out = []
    with rk.capture(m, backend="emulated") if mode == "capture" else torch.enable_grad():
        for i in range(6):
            EPOCH = i // 2
            if step is not None:
                out.append(step(torch.ones(3, 4)))
                continue
            loss = loss_fn(m, torch.ones(3, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
    return out


for how in ("own method", "held method", "held property", "no_grad helper"):
    ref = run("eager", how)
    for mode in ("capture", "step"):
        got = run(mode, how)
        bad = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if not torch.equal(a, b)]
        print(f"{how:14s} {mode:8s}: " + (f"SILENT loss differs from call {bad[0]}: "
              f"{ref[bad[0]].item():.6f} vs {got[bad[0]].item():.6f}" if bad else "equal"))  # fmt: skip
