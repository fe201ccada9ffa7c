"""Round 9 harness: each pattern runs the same loop twice from one seed, plain eager (no replaykit)
and through replaykit (backend="emulated"), compared bitwise after every step.

A pattern is ``fn(run)``; ``run.rk`` says which arm. Entry points go through ``run.step`` (a
``rk.TrainStep`` or its documented body by hand) and ``run.wrap`` (``rk.capture`` or nothing);
``run.snap(...)`` records every parameter, every ``.grad`` (None pattern), buffers, optimizer
state and whatever the loop keeps.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import traceback
import types
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
        return ("T", v.detach().clone(), v.dtype, tuple(v.shape), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return ("L", [clone(x) for x in v])
    if isinstance(v, dict):
        return ("D", {str(k): clone(x) for k, x in v.items()})
    return ("P", v)


def same(a, b):
    if a[0] != b[0]:
        return False
    if a[0] == "T":
        return a[2:] == b[2:] and torch.equal(a[1], b[1])
    if a[0] == "L":
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1], strict=False))
    if a[0] == "D":
        return a[1].keys() == b[1].keys() and all(same(a[1][k], b[1][k]) for k in a[1])
    return a[1] == b[1]


def maxdiff(a, b):
    try:
        return float((a[1].double() - b[1].double()).abs().max())
    except Exception:
        return None


class Run:
    """One arm: ``use_rk`` False is plain eager."""

    def __init__(self, use_rk: bool):
        self.rk = use_rk
        self.steps: list[dict] = []
        self.entries: list = []

    def wrap(self, module, **kw):
        if self.rk:
            opts = dict(backend="emulated", warmup=1)
            opts.update(kw)
            rk.capture(module, **opts)
            self.entries.append(rk.recorder_of(module))
        return module

    def step(self, model, loss_fn, opt, **kw):
        """rk.TrainStep, or eagerly its documented body by hand."""
        if self.rk:
            s = rk.TrainStep(model, loss_fn, opt, backend="emulated", **kw)
            self.entries.append(s)
            return s
        acc = kw.get("accumulate", 1)
        prec = kw.get("precision", "32")
        state = {"n": 0}

        def plain(*a, **k):
            ctx = (
                torch.autocast("cpu", dtype=torch.bfloat16)
                if prec == "bf16-mixed"
                else contextlib.nullcontext()
            )
            with ctx:
                loss = loss_fn(model, *a, **k)
            (loss / acc if acc > 1 else loss).backward()
            state["n"] += 1
            if state["n"] % acc == 0:
                if kw.get("max_norm") is not None:
                    ps = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
                    torch.nn.utils.clip_grad_norm_(ps, kw["max_norm"], foreach=True)
                opt.step()
                if kw.get("ema") is not None:
                    kw["ema"].update()
                opt.zero_grad(set_to_none=True)
            return loss.detach()

        return plain

    def snap(self, modules=(), opts=(), **extras):
        d = {}
        for mi, m in enumerate(modules):
            if m is None:
                continue
            for n, p in m.named_parameters(remove_duplicate=False):
                d[f"m{mi}.param:{n}"] = clone(p)
                d[f"m{mi}.grad:{n}"] = clone(p.grad) if p.grad is not None else ("P", None)
            for n, b in m.named_buffers():
                d[f"m{mi}.buf:{n}"] = clone(b)
        for oi, opt in enumerate(opts):
            sd = opt.state_dict()
            d[f"opt{oi}"] = clone({str(k): v for k, v in sd["state"].items()})
        for k, v in extras.items():
            d[k] = clone(v)
        self.steps.append(d)


def compare(e: Run, c: Run):
    if len(e.steps) != len(c.steps):
        return f"step count {len(e.steps)} vs {len(c.steps)}"
    for i, (a, b) in enumerate(zip(e.steps, c.steps, strict=False)):
        if a.keys() != b.keys():
            return f"step {i}: keys differ {sorted(set(a) ^ set(b))[:4]}"
        for k in a:
            if not same(a[k], b[k]):
                md = maxdiff(a[k], b[k]) if a[k][0] == "T" and b[k][0] == "T" else None
                return f"step {i}: {k} differs (max abs {md})"
    return None


def info(run: Run):
    replays, parts = 0, []
    for ent in run.entries:
        with contextlib.suppress(Exception):
            counts = {
                k: v
                for k, v in dict(ent.counts).items()
                if v and k not in ("release", "check", "hold_end")
            }
            replays += counts.get("replay", 0)
            s = f"{type(ent).__name__}{counts} eager={dict(ent.eager_reasons)}"
            if getattr(ent, "retired", False):
                s += f" RETIRED: {str(ent.retire_reason)[:160]}"
            oe = getattr(ent, "optimizer_eager", None)
            if oe:
                s += f" opt_eager={str(oe)[:60]}"
            parts.append(s)
    return replays, " ; ".join(parts)


def _release(run: Run):
    for ent in run.entries:
        with contextlib.suppress(Exception):
            ent.release()


def run_pattern(name, fn, timeout=120):
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        e = Run(False)
        try:
            fn(e)
        except Timeout:
            raise
        except Exception as ex:
            return "INVALID", 0, f"eager raised {type(ex).__name__}: {ex}"
        c = Run(True)
        try:
            fn(c)
        except rk.ReplayError as ex:
            n, i = info(c)
            return "raised-clear", n, f"ReplayError: {str(ex)[:300]} | {i}"
        except Timeout:
            raise
        except Exception as ex:
            n, i = info(c)
            tb = " / ".join(traceback.format_exc().splitlines()[-6:])
            return "UNCLEAR", n, f"{type(ex).__name__}: {str(ex)[:300]} | {i} | {tb}"
        finally:
            _release(c)
        diff = compare(e, c)
        n, i = info(c)
        if diff is not None:
            return "SILENT", n, f"{diff} | {i}"
        return ("replayed-bitwise" if n > 0 else "eager-exact"), n, i
    except Timeout:
        return "TIMEOUT", 0, f"hang > {timeout}s"
    finally:
        signal.alarm(0)
        gc.collect()


__all__ = ["Run", "run_pattern", "types"]
