"""Harness: run a pattern eagerly and under rk.capture(emulated), compare bitwise after every step."""

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
        return ("T", v.detach().clone(), v.dtype, tuple(v.shape), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return ("L", [clone(x) for x in v])
    if isinstance(v, dict):
        return ("D", {k: clone(x) for k, x in v.items()})
    return ("P", v)


def same(a, b):
    if a[0] != b[0]:
        return False
    if a[0] == "T":
        return a[2] == b[2] and a[3] == b[3] and a[4] == b[4] and torch.equal(a[1], b[1])
    if a[0] == "L":
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1], strict=False))
    if a[0] == "D":
        return a[1].keys() == b[1].keys() and all(same(a[1][k], b[1][k]) for k in a[1])
    return a[1] == b[1]


class Run:
    """What one arm saw: one snapshot dict per step."""

    def __init__(self, capture: bool, **kw):
        self.capture = capture
        self.kw = kw
        self.steps: list[dict] = []
        self.rec = None

    def wrap(self, module, **kw):
        if self.capture:
            opts = dict(backend="emulated", warmup=1)
            opts.update(self.kw)
            opts.update(kw)
            self.rec = rk.capture(module, **opts)
        return module

    def snap(self, model=None, **extras):
        d = {}
        if model is not None:
            for n, p in model.named_parameters():
                d["param:" + n] = clone(p)
                d["grad:" + n] = clone(p.grad) if p.grad is not None else ("P", None)
            for n, b in model.named_buffers():
                d["buf:" + n] = clone(b)
        for k, v in extras.items():
            d[k] = clone(v)
        self.steps.append(d)


def compare(e: Run, c: Run):
    if len(e.steps) != len(c.steps):
        return f"step count {len(e.steps)} vs {len(c.steps)}"
    for i, (a, b) in enumerate(zip(e.steps, c.steps, strict=False)):
        if a.keys() != b.keys():
            return f"step {i}: keys differ {set(a) ^ set(b)}"
        for k in a:
            if not same(a[k], b[k]):
                return f"step {i}: {k} differs"
    return None


def rec_info(rec):
    if rec is None:
        return 0, ""
    counts = dict(rec.counts)
    reasons = dict(rec.eager_reasons)
    info = f"counts={counts} eager={reasons}"
    if rec.retired:
        info += f" RETIRED: {rec.retire_reason}"
    return counts.get("replay", 0), info


def run_pattern(name, fn, timeout=120):
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        try:
            e = Run(False)
            fn(e)
        except Timeout:
            raise
        except Exception as ex:
            return name, "EAGER RAISED (invalid pattern)", 0, f"{type(ex).__name__}: {ex}"
        c = Run(True)
        try:
            fn(c)
        except rk.ReplayError as ex:
            n, info = rec_info(c.rec)
            return name, "clear error", n, f"ReplayError: {str(ex)[:300]} | {info}"
        except Timeout:
            raise
        except Exception as ex:
            n, info = rec_info(c.rec)
            tb = traceback.format_exc().splitlines()[-6:]
            return (
                name,
                "UNCLEAR ERROR",
                n,
                f"{type(ex).__name__}: {str(ex)[:300]} | {info} | {' / '.join(tb)}",
            )
        finally:
            if c.rec is not None:
                with contextlib.suppress(Exception):
                    c.rec.release()
        diff = compare(e, c)
        n, info = rec_info(c.rec)
        if diff is not None:
            return name, "SILENT DIFF", n, f"{diff} | {info}"
        if n > 0:
            return name, "replayed bitwise", n, info
        return name, "routed/retired (exact)", n, info
    except Timeout:
        return name, "TIMEOUT", 0, f"hang > {timeout}s"
    finally:
        signal.alarm(0)
