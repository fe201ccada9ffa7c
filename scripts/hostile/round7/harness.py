"""Harness: one pattern trained three ways -- a plain hand-written eager loop, rk.TrainStep's eager
twin (replay=False) and rk.TrainStep(backend="emulated") -- compared bitwise after every call.

The plain arm runs the body DESIGN.md documents for TrainStep (autocast around loss_fn,
loss / accumulate, backward, on the last micro-batch clip_grad_norm_, optimizer.step, EMA.update,
zero_grad(set_to_none=True)), so a difference the twin shares with the replay is seen too.
requires_grad of user-visible tensors other than parameters is not compared (documented: the
attributes bound after a replay are copies that do not require grad).
"""

from __future__ import annotations

import contextlib
import signal
import traceback
import warnings

import torch

import replaykit as rk

warnings.simplefilter("ignore")


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("timeout")


def clone(v):
    if isinstance(v, torch.Tensor):
        return ("T", v.detach().clone(), v.dtype, tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return ("L", [clone(x) for x in v])
    if isinstance(v, dict):
        return ("D", {k: clone(x) for k, x in v.items()})
    return ("P", v)


def same(a, b):
    if a[0] != b[0]:
        return False
    if a[0] == "T":
        return a[2] == b[2] and a[3] == b[3] and torch.equal(a[1], b[1])
    if a[0] == "L":
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1], strict=False))
    if a[0] == "D":
        return a[1].keys() == b[1].keys() and all(same(a[1][k], b[1][k]) for k in a[1])
    return a[1] == b[1]


class PlainStep:
    """The documented body, by hand: what a user's own eager loop does."""

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        *,
        max_norm=None,
        ema=None,
        accumulate=1,
        precision="32",
        **_,
    ):
        self.model, self.loss_fn, self.opt = model, loss_fn, optimizer
        self.max_norm, self.ema, self.acc, self.precision = max_norm, ema, accumulate, precision
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if self.precision == "bf16-mixed":
            ctx = torch.autocast("cpu", dtype=torch.bfloat16)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            loss = self.loss_fn(self.model, *args, **kwargs)
        (loss / self.acc).backward()
        self.calls += 1
        if self.calls % self.acc == 0:
            if self.max_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.opt.step()
            if self.ema is not None:
                self.ema.update()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach().clone()


class Run:
    """One arm: mode 'plain', 'twin' or 'replay'; one snapshot dict per call."""

    def __init__(self, mode: str):
        self.mode = mode
        self.steps: list[dict] = []
        self.trainsteps: list = []

    def step(self, model, loss_fn, optimizer, **kw):
        if self.mode == "plain":
            s = PlainStep(model, loss_fn, optimizer, **kw)
        else:
            s = rk.TrainStep(
                model, loss_fn, optimizer, backend="emulated", replay=self.mode == "replay", **kw
            )
        self.trainsteps.append(s)
        return s

    def snap(self, model=None, opt=None, ema=None, **extras):
        d = {}
        if model is not None:
            for n, p in model.named_parameters():
                d["param:" + n] = (*clone(p), p.requires_grad)
                d["grad:" + n] = clone(p.grad) if p.grad is not None else ("P", None)
            for n, b in model.named_buffers():
                d["buf:" + n] = clone(b)
        if opt is not None:
            sd = opt.state_dict()
            d["opt_state"] = clone({str(k): v for k, v in sd["state"].items()})
            d["opt_groups"] = clone(
                [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            )
        if ema is not None:
            d["ema"] = clone(list(ema.tensors()))
        for k, v in extras.items():
            d[k] = clone(v)
        self.steps.append(d)


def compare(e: Run, c: Run):
    if len(e.steps) != len(c.steps):
        return f"call count {len(e.steps)} vs {len(c.steps)}"
    for i, (a, b) in enumerate(zip(e.steps, c.steps, strict=False)):
        if a.keys() != b.keys():
            return f"call {i}: keys differ {set(a) ^ set(b)}"
        for k in a:
            if not same(a[k], b[k]):
                return f"call {i}: {k} differs"
    return None


def step_info(run: Run):
    replays, parts = 0, []
    for s in run.trainsteps:
        if not isinstance(s, rk.TrainStep):
            continue
        counts = dict(s.counts)
        replays += counts.get("replay", 0)
        calls = counts.get("replay", 0) + counts.get("eager", 0) + counts.get("record", 0)
        info = f"replay {counts.get('replay', 0)}/{calls} eager={dict(s.eager_reasons)}"
        if counts.get("rerecord"):
            info += f" rerecord={counts['rerecord']}"
        if s.retired:
            info += f" RETIRED: {s.retire_reason}"
        parts.append(info)
    return replays, " ; ".join(parts)


def _release(run: Run):
    for s in run.trainsteps:
        if isinstance(s, rk.TrainStep):
            with contextlib.suppress(Exception):
                s.release()


def run_pattern(name, fn, timeout=60):
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        p = Run("plain")
        try:
            fn(p)
        except Timeout:
            raise
        except Exception as ex:
            return name, "INVALID (plain raised)", 0, f"{type(ex).__name__}: {ex}"
        t = Run("twin")
        try:
            fn(t)
        except Timeout:
            raise
        except Exception as ex:
            return name, "TWIN RAISED", 0, f"{type(ex).__name__}: {str(ex)[:300]}"
        finally:
            _release(t)
        twin_diff = compare(p, t)
        c = Run("replay")
        try:
            fn(c)
        except rk.ReplayError as ex:
            n, info = step_info(c)
            return name, "raised-clear", n, f"ReplayError: {str(ex)[:300]} | {info}"
        except Timeout:
            raise
        except Exception as ex:
            n, info = step_info(c)
            tb = traceback.format_exc().splitlines()[-6:]
            return (
                name,
                "RAISED-UNCLEAR",
                n,
                f"{type(ex).__name__}: {str(ex)[:300]} | {info} | {' / '.join(tb)}",
            )
        finally:
            _release(c)
        diff = compare(p, c)
        n, info = step_info(c)
        if twin_diff is not None:
            return name, "SILENT (twin != plain)", n, f"twin: {twin_diff} | replay: {diff} | {info}"
        if diff is not None:
            return name, "SILENT", n, f"{diff} | {info}"
        if n > 0:
            return name, "replayed-bitwise", n, info
        return name, "eager-exact", n, info
    except Timeout:
        return name, "TIMEOUT", 0, f"hang > {timeout}s"
    finally:
        signal.alarm(0)
