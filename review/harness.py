"""Adversarial review harness: one pattern = setup(replay) + drive(env); eager twin vs replay, bitwise."""

from __future__ import annotations

import traceback

import torch
from torch import nn

from replaykit.bitwise import diff_states
from replaykit.step import EMA, TrainStep  # noqa: F401
from replaykit.testing.end_state import module_state, optimizer_state, scaler_state, scheduler_state

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self, width: int = 16, classes: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.bn(self.l1(x)))))


def ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def batch(g, n=6):
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def collect(env) -> dict:
    state = module_state(env["model"])
    state.update(optimizer_state([env["opt"]]))
    state.update(scaler_state(env.get("scaler")))
    if env.get("sched") is not None:
        state.update(scheduler_state([env["sched"]]))
    if env.get("ema") is not None:
        state.update({f"ema/{i}": t.detach().clone() for i, t in enumerate(env["ema"].params)})
    for i, t in enumerate(env.get("losses", [])):
        state[f"loss/{i}"] = None if t is None else t.detach().clone()
    for i, t in enumerate(env.get("kept", [])):
        state[f"kept/{i}"] = None if t is None else t.detach().clone()
    for k, v in env.get("extra", {}).items():
        state[f"extra/{k}"] = v
    return state


def one(setup, drive, replay):
    torch.manual_seed(0)
    env = setup(replay)
    env.setdefault("losses", [])
    env.setdefault("kept", [])
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(2)
    err = None
    try:
        drive(env, g)
    except BaseException as exc:  # noqa: BLE001
        err = f"{type(exc).__name__}: {exc}"
        env["tb"] = traceback.format_exc()
    return env, collect(env), err


def check(name, setup, drive, verbose=False):
    e0, s0, err0 = one(setup, drive, False)
    e1, s1, err1 = one(setup, drive, True)
    step = e1["step"]
    diffs = diff_states(s0, s1)
    reasons = {k: v for k, v in step.eager_reasons.items() if k != "warmup"}
    routed = bool(reasons) or step.retire_reason is not None
    c = step.counts
    if err0 != err1:
        cls = "CRASH?" if err1 else "DIFF-ERR"
    elif diffs:
        cls = "SILENT" if not routed else "DIFF+REASON"
    elif err1:
        cls = "ERROR(both)"
    else:
        cls = "ROUTED" if routed else "OK"
    print(f"{cls:11s} {name}: rec={c['record']} rep={c['replay']} eager={c['eager']} copy_out={c['copy_out']} "
          f"reasons={dict(reasons)} retire={step.retire_reason!r} errs={err0!r}/{err1!r}")
    if diffs:
        print("    diffs:", [(d.name, d.problem, d.max_abs) for d in diffs[:6]], f"({len(diffs)} total)")
    if verbose or (err1 and err1 != err0):
        print(e1.get("tb", ""))
    return cls, diffs, e0, e1


def basic_setup(opt_fn=None, model_fn=Net, loss_fn=ce, **kw):
    def setup(replay):
        model = model_fn()
        opt = opt_fn(model) if opt_fn else torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        step = TrainStep(model, loss_fn, opt, replay=replay, **kw)
        return {"model": model, "opt": opt, "step": step}

    return setup


def simple_drive(n=6, between=None):
    def drive(env, g):
        for i in range(n):
            x, y = batch(g)
            env["losses"].append(env["step"](x, y))
            if between:
                between(env, i)

    return drive
