"""Harness: one pattern run eagerly (no replaykit) and with replaykit(emulated), compared bitwise
after every step; each pattern run with the storage swap (this torch) and without it (as on torch
2.11: ``copy_out._swap = None`` before anything is built, the project's own emulation)."""

from __future__ import annotations

import contextlib
import gc
import signal
import traceback
import warnings

import torch

import replaykit as rk
from replaykit.memory import copy_out

warnings.simplefilter("ignore")
SWAP = copy_out._swap


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
        return a[2:] == b[2:] and torch.equal(a[1], b[1])
    if a[0] == "L":
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1], strict=False))
    if a[0] == "D":
        return a[1].keys() == b[1].keys() and all(same(a[1][k], b[1][k]) for k in a[1])
    return a[1] == b[1]


class Run:
    """One arm: ``rk`` False is plain eager (every rk entry point is skipped)."""

    def __init__(self, use_rk: bool):
        self.rk = use_rk
        self.steps: list[dict] = []
        self.entries: list = []

    def wrap(self, module, **kw):
        if self.rk:
            opts = dict(backend="emulated")
            opts.update(kw)
            self.entries.append(rk.capture(module, **opts))
        return module

    def note(self, ent):
        """Freeze an entry point's tallies now (before it is dropped for the collector)."""
        import types

        self.entries.append(
            types.SimpleNamespace(
                counts=dict(ent.counts),
                eager_reasons=dict(ent.eager_reasons),
                retired=ent.retired,
                retire_reason=ent.retire_reason,
                release=lambda: None,
            )
        )

    def pool(self):
        return rk.MemoryPool() if self.rk else None

    def step(self, model, loss_fn, opt, **kw):
        """rk.TrainStep or, eagerly, its documented body by hand (set_to_none=True)."""
        if self.rk:
            s = rk.TrainStep(model, loss_fn, opt, backend="emulated", **kw)
            self.entries.append(s)
            return s
        acc = kw.get("accumulate", 1)
        state = {"n": 0}

        def plain(*a):
            loss = loss_fn(model, *a)
            (loss / acc).backward()
            state["n"] += 1
            if state["n"] % acc == 0:
                if kw.get("max_norm") is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), kw["max_norm"])
                opt.step()
                opt.zero_grad(set_to_none=True)
            return loss.detach().clone()

        return plain

    def snap(self, model=None, opt=None, **extras):
        d = {}
        for mi, m in enumerate(model if isinstance(model, (list, tuple)) else [model]):
            if m is None:
                continue
            for n, p in m.named_parameters():
                d[f"param{mi}:{n}"] = clone(p)
                d[f"grad{mi}:{n}"] = clone(p.grad) if p.grad is not None else ("P", None)
            for n, b in m.named_buffers():
                d[f"buf{mi}:{n}"] = clone(b)
        if opt is not None:
            sd = opt.state_dict()
            d["opt_state"] = clone({str(k): v for k, v in sd["state"].items()})
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
            s = f"{type(ent).__name__.replace('SimpleNamespace', 'Dropped')}{counts} eager={dict(ent.eager_reasons)}"
            if getattr(ent, "retired", False):
                s += f" RETIRED: {ent.retire_reason}"
            parts.append(s)
    return replays, " ; ".join(parts)


def _release(run: Run):
    for ent in run.entries:
        with contextlib.suppress(Exception):
            ent.release()


def run_pattern(name, fn, swap: bool, timeout=60):
    copy_out._swap = SWAP if swap else None
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
            return "RAISED-UNCLEAR", n, f"{type(ex).__name__}: {str(ex)[:300]} | {i} | {tb}"
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
        copy_out._swap = SWAP
        gc.collect()
