"""Hostile single-process review: each scenario runs twice in one process, plainly in eager and
under replaykit's public API (emulated backend), from the same seeds; the end states must be
bitwise equal (``torch.equal``, same ``.grad`` None pattern).

``python scripts/hostile/single/run.py [names...] [--timeout 90]`` runs every scenario (or the
named ones) in a child process each and prints the table.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

REGISTRY: dict[str, tuple[str, Callable]] = {}


def scenario(entry: str) -> Callable:
    """Register ``fn(ctx) -> dict`` under its name; entry: capture | step | whole_step."""

    def deco(fn: Callable) -> Callable:
        REGISTRY[fn.__name__] = (entry, fn)
        return fn

    return deco


def seed_all(s: int = 0) -> None:
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


class PlainStep:
    """What a user writes by hand for one TrainStep call (the same order of work)."""

    def __init__(self, model, loss_fn, opt, *, scaler=None, max_norm=None, accumulate=1,
                 precision="32", ema=None) -> None:  # fmt: skip
        self.model, self.loss_fn, self.opt = model, loss_fn, opt
        self.scaler, self.max_norm, self.acc = scaler, max_norm, accumulate
        self.dtype = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}[
            precision
        ]
        self.ema, self.micro = ema, 0

    def __call__(self, *args, **kwargs):
        self.micro = self.micro % self.acc + 1
        sync = self.micro == self.acc
        ac = torch.autocast("cpu", dtype=self.dtype) if self.dtype else contextlib.nullcontext()
        with ac:
            loss = self.loss_fn(self.model, *args, **kwargs)
        scaled = loss / self.acc if self.acc > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if sync:
            if self.max_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.opt)
                ps = list(self.model.parameters()) + [
                    p for g in self.opt.param_groups for p in g["params"]
                ]
                ps = [p for p in dict.fromkeys(ps) if p.requires_grad and p.grad is not None]
                nn.utils.clip_grad_norm_(ps, self.max_norm, foreach=True, error_if_nonfinite=False)
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
            if self.ema is not None:
                self.ema.update()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class Ctx:
    """Handed to a scenario: the mode and the entry points for it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.entries: list[Any] = []

    @property
    def replay(self) -> bool:
        return self.mode == "replay"

    @contextlib.contextmanager
    def capture(self, model: nn.Module, **kw):
        if not self.replay:
            yield None
            return
        import replaykit as rk

        with rk.capture(model, backend="emulated", **kw) as rec:
            self.entries.append(rec)
            yield rec

    def step(self, model, loss_fn, opt, **kw):
        if not self.replay:
            return PlainStep(model, loss_fn, opt, **kw)
        import replaykit as rk

        st = rk.TrainStep(model, loss_fn, opt, backend="emulated", **kw)
        self.entries.append(st)
        return st

    def ema(self, model, decay):
        """rk.EMA in both modes (the public EMA the step takes)."""
        import replaykit as rk

        return rk.EMA(model, decay)


def _flat(prefix: str, obj: Any, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone()
    elif isinstance(obj, nn.Module):
        for n, p in obj.named_parameters():
            out[f"{prefix}/param/{n}"] = p.detach().clone()
            out[f"{prefix}/grad/{n}"] = None if p.grad is None else p.grad.detach().clone()
        for n, b in obj.named_buffers():
            out[f"{prefix}/buffer/{n}"] = b.detach().clone()
    elif isinstance(obj, torch.optim.Optimizer):
        sd = obj.state_dict()
        _flat(f"{prefix}/state", sd["state"], out)
        for i, g in enumerate(sd["param_groups"]):
            for k, v in g.items():
                if k != "params":
                    _flat(f"{prefix}/group{i}/{k}", v, out)
    elif hasattr(obj, "state_dict") and hasattr(obj, "scale"):  # GradScaler
        _flat(f"{prefix}/scaler", obj.state_dict(), out)
    elif hasattr(obj, "params") and hasattr(obj, "update"):  # rk.EMA
        _flat(f"{prefix}/ema", list(obj.params), out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}/{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flat(f"{prefix}/{i}", v, out)
    elif isinstance(obj, (int, float, bool, str, np.floating, np.integer)) or obj is None:
        out[prefix] = obj.item() if isinstance(obj, (np.floating, np.integer)) else obj


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if torch.equal(a, b):
            return True
        if not a.is_floating_point():
            return False
        na, nb = a.isnan(), b.isnan()
        return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


def diff(a: dict, b: dict) -> list[str]:
    out = [f"missing:{k}" for k in a.keys() ^ b.keys()]
    out += [k for k in a.keys() & b.keys() if not same(a[k], b[k])]
    return sorted(out)


def entry_info(entries: list) -> dict:
    counts: Counter = Counter()
    reasons: Counter = Counter()
    retired = []
    for e in entries:
        for k, v in e.counts.items():
            counts[k] += v
        for r, n in e.eager_reasons.items():
            reasons[str(r)[:100]] += n
        if getattr(e, "retired", False):
            retired.append(str(getattr(e, "retire_reason", ""))[:160])
    return {"counts": dict(counts), "reasons": dict(reasons), "retired": retired}


def run_mode(name: str, mode: str) -> tuple[dict | None, str | None, dict, list[str]]:
    _entry, fn = REGISTRY[name]
    ctx = Ctx(mode)
    seed_all(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = fn(ctx)
            state: dict = {}
            _flat("", res, state)
            err = None
        except Exception as e:
            state, err = None, f"{type(e).__name__}: {str(e)[:300]}"
    warns = sorted(
        {str(w.message)[:200] for w in caught if "ReplayWarning" in type(w.message).__name__}
    )
    info = entry_info(ctx.entries) if ctx.entries else {}
    return state, err, info, warns
