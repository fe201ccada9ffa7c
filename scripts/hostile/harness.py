"""The hostile rounds' harness (rounds 6-12): each pattern runs the same loop from one seed, plain
eager (no replaykit) and through replaykit (backend="emulated"), compared bitwise (torch.equal)
after every step, and the outcome is classified: exact (replayed or eager), silent difference,
clear ``ReplayError``, unclear error, invalid pattern (eager raised) or timeout.

A pattern is ``fn(run)``; ``run.rk`` says which arm (``run.mode``: plain, twin or replay). Models
go through ``run.wrap`` (``rk.capture`` or nothing) and ``run.step`` (``rk.TrainStep`` or its
documented body by hand); ``run.snap(...)`` records every parameter (with requires_grad), every
``.grad`` (None pattern), buffers, optimizer state and hyperparameters, EMA tensors and whatever
the loop keeps. What differs between rounds is a :class:`Profile` (labels, warmup, clipping, ...)
so each round's table reads as it always has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import signal
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

import replaykit as rk
from replaykit.memory import copy_out

warnings.simplefilter("ignore")
IGNORED_COUNTS = ("release", "check", "hold_end")


class Timeout(Exception):
    """A pattern that hangs gets a verdict instead of stopping the round."""


def _alarm(signum, frame):
    raise Timeout("timeout")


@dataclasses.dataclass(frozen=True)
class Labels:
    """Verdict names; a round keeps its own so its recorded tables stay comparable."""

    invalid: str = "INVALID"
    clear: str = "raised-clear"
    unclear: str = "UNCLEAR"
    silent: str = "SILENT"
    replayed: str = "replayed-bitwise"
    exact: str = "eager-exact"


@dataclasses.dataclass(frozen=True)
class Profile:
    """How a round runs its patterns.

    ``warmup``: rk.capture's (None: capture's own default). ``clip_optimizer_params``: the plain
    arm clips the optimizer's gradients (foreach) as TrainStep does, else ``model.parameters()``.
    ``requires_grad``: compare it on tensors other than parameters too (round 7 does not: the
    attributes bound after a replay are documented copies that do not require grad). ``twin``:
    also run TrainStep(replay=False) and hold it to the plain arm, so a difference the twin
    shares with the replay is seen. ``collect``: gc.collect() after each pattern, so what one
    pattern dropped is not collected inside the next (rounds 8 on test the collector; about
    0.1 s a pattern, which rounds 6 and 7 skip).
    """

    labels: Labels = Labels()
    timeout: int = 120
    warmup: int | None = 1
    clip_optimizer_params: bool = True
    requires_grad: bool = True
    twin: bool = False
    collect: bool = True


ROUND6 = Profile(
    Labels(
        "EAGER RAISED (invalid pattern)",
        "clear error",
        "UNCLEAR ERROR",
        "SILENT DIFF",
        "replayed bitwise",
        "routed/retired (exact)",
    ),
    collect=False,
)
ROUND7 = Profile(
    Labels(invalid="INVALID (plain raised)", unclear="RAISED-UNCLEAR"),
    timeout=60,
    clip_optimizer_params=False,
    requires_grad=False,
    twin=True,
    collect=False,
)
ROUND8 = Profile(
    Labels(unclear="RAISED-UNCLEAR"), timeout=60, warmup=None, clip_optimizer_params=False
)
ROUND9 = Profile()


# ------------------------------------------------------------------------------ snapshots
def clone(v, requires_grad: bool = True):
    """A comparable copy: tensors with dtype, shape (and requires_grad); dict keys as strings, so
    an object key (a tensor, a module) compares by what it prints, not by identity."""
    if isinstance(v, torch.Tensor):
        meta = (v.requires_grad,) if requires_grad else ()
        return ("T", v.detach().clone(), v.dtype, tuple(v.shape), *meta)
    if isinstance(v, (list, tuple)):
        return ("L", [clone(x, requires_grad) for x in v])
    if isinstance(v, dict):
        return ("D", {str(k): clone(x, requires_grad) for k, x in v.items()})
    return ("P", v)


def same(a, b) -> bool:
    """Bitwise equal (torch.equal) with the same dtype, shape and flags, walked through
    containers."""
    if a[0] != b[0]:
        return False
    if a[0] == "T":
        return a[2:] == b[2:] and torch.equal(a[1], b[1])
    if a[0] == "L":
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1], strict=False))
    if a[0] == "D":
        return a[1].keys() == b[1].keys() and all(same(a[1][k], b[1][k]) for k in a[1])
    return a[1] == b[1]


def maxdiff(a, b) -> float | None:
    """How far apart two differing tensors are, for the detail column."""
    try:
        return float((a[1].double() - b[1].double()).abs().max())
    except Exception:
        return None


def compare(steps_a: list[dict], steps_b: list[dict]) -> str | None:
    """The first difference between two arms' snapshots, or None."""
    if len(steps_a) != len(steps_b):
        return f"step count {len(steps_a)} vs {len(steps_b)}"
    for i, (a, b) in enumerate(zip(steps_a, steps_b, strict=False)):
        if a.keys() != b.keys():
            return f"step {i}: keys differ {sorted(set(a) ^ set(b))[:4]}"
        for k in a:
            if not same(a[k], b[k]):
                md = maxdiff(a[k], b[k]) if a[k][0] == "T" and b[k][0] == "T" else None
                return f"step {i}: {k} differs (max abs {md})"
    return None


def _listed(x, kind: type) -> list:
    """One object or a sequence of them (None: none)."""
    if x is None:
        return []
    return [x] if isinstance(x, kind) else list(x)


# ------------------------------------------------------------------------------ the arms
class PlainStep:
    """TrainStep's documented body by hand, what a user's own loop does: autocast around loss_fn,
    loss / accumulate, backward; on the last micro-batch clip_grad_norm_, optimizer.step,
    ema.update, zero_grad(set_to_none=True)."""

    def __init__(
        self,
        model,
        loss_fn,
        opt,
        *,
        clip_optimizer_params: bool,
        accumulate=1,
        max_norm=None,
        ema=None,
        precision="32",
        **_,
    ):
        self.model, self.loss_fn, self.opt, self.ema = model, loss_fn, opt, ema
        self.acc, self.max_norm, self.precision = accumulate, max_norm, precision
        self.clip_optimizer_params = clip_optimizer_params
        self.calls = 0

    def _clip(self) -> None:
        if self.clip_optimizer_params:
            ps = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(ps, self.max_norm, foreach=True)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)

    def __call__(self, *args, **kwargs):
        ctx = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if self.precision == "bf16-mixed"
            else contextlib.nullcontext()
        )
        with ctx:
            loss = self.loss_fn(self.model, *args, **kwargs)
        (loss / self.acc if self.acc > 1 else loss).backward()
        self.calls += 1
        if self.calls % self.acc == 0:
            if self.max_norm is not None:
                self._clip()
            self.opt.step()
            if self.ema is not None:
                self.ema.update()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach().clone()


class Run:
    """One arm: mode "plain" (no replaykit), "twin" (TrainStep replay=False) or "replay"."""

    def __init__(self, mode: str, profile: Profile):
        self.mode, self.profile = mode, profile
        self.rk = mode != "plain"
        self.steps: list[dict] = []
        self.entries: list = []

    def wrap(self, module, **kw):
        if self.rk:
            opts = {"backend": "emulated"}
            if self.profile.warmup is not None:
                opts["warmup"] = self.profile.warmup
            self.entries.append(rk.capture(module, **(opts | kw)))
        return module

    def step(self, model, loss_fn, opt, **kw):
        if not self.rk:
            return PlainStep(
                model, loss_fn, opt, clip_optimizer_params=self.profile.clip_optimizer_params, **kw
            )
        if self.mode == "twin":
            kw["replay"] = False
        s = rk.TrainStep(model, loss_fn, opt, backend="emulated", **kw)
        self.entries.append(s)
        return s

    def pool(self):
        return rk.MemoryPool() if self.rk else None

    def note(self, ent) -> None:
        """Freeze an entry point's tallies now (before it is dropped for the collector)."""
        self.entries.append(
            types.SimpleNamespace(
                counts=dict(ent.counts),
                eager_reasons=dict(ent.eager_reasons),
                retired=ent.retired,
                retire_reason=ent.retire_reason,
                release=lambda: None,
            )
        )

    def snap(self, modules=(), opts=(), ema=None, /, **extras) -> None:
        """Record one step: ``modules``/``opts`` one object or a sequence (None: none), ``ema`` an
        rk.EMA; positional only, so any name (``ema=`` too) is free for what the loop keeps."""
        rg = self.profile.requires_grad
        d = {}
        for mi, m in enumerate(_listed(modules, nn.Module)):
            if m is None:  # a model the loop builds later (a teacher)
                continue
            for n, p in m.named_parameters(remove_duplicate=False):
                d[f"m{mi}.param:{n}"] = clone(p)
                d[f"m{mi}.grad:{n}"] = clone(p.grad, rg) if p.grad is not None else ("P", None)
            for n, b in m.named_buffers():
                d[f"m{mi}.buf:{n}"] = clone(b, rg)
        for oi, opt in enumerate(_listed(opts, torch.optim.Optimizer)):
            sd = opt.state_dict()
            d[f"opt{oi}"] = clone({str(k): v for k, v in sd["state"].items()}, rg)
            groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            d[f"opt{oi}.groups"] = clone(groups, rg)
        if ema is not None:
            d["ema"] = clone(list(ema.tensors()), rg)
        for k, v in extras.items():
            d[k] = clone(v, rg)
        self.steps.append(d)

    def info(self) -> tuple[int, str]:
        """Replays in all, and each entry point's tallies."""
        replays, parts = 0, []
        for ent in self.entries:
            with contextlib.suppress(Exception):
                counts = {
                    k: v for k, v in dict(ent.counts).items() if v and k not in IGNORED_COUNTS
                }
                replays += counts.get("replay", 0)
                name = type(ent).__name__.replace("SimpleNamespace", "Dropped")
                s = f"{name}{counts} eager={dict(ent.eager_reasons)}"
                if getattr(ent, "retired", False):
                    s += f" RETIRED: {str(ent.retire_reason)[:160]}"
                oe = getattr(ent, "optimizer_eager", None)
                if oe:
                    s += f" opt_eager={str(oe)[:60]}"
                parts.append(s)
        return replays, " ; ".join(parts)

    def release(self) -> None:
        for ent in self.entries:
            with contextlib.suppress(Exception):
                ent.release()


# ------------------------------------------------------------------------------ verdicts
def _arm(fn, mode: str, profile: Profile) -> Run:
    """Run ``fn`` in one arm; whatever it raises propagates, the arm is released either way."""
    run = Run(mode, profile)
    try:
        fn(run)
    finally:
        if mode != "plain":
            run.release()
    return run


def _verdict(fn, p: Profile) -> tuple[str, int, str]:
    try:
        plain = _arm(fn, "plain", p)
    except Timeout:
        raise
    except Exception as ex:
        return p.labels.invalid, 0, f"eager raised {type(ex).__name__}: {ex}"
    twin_diff = None
    if p.twin:
        try:
            twin_diff = compare(plain.steps, _arm(fn, "twin", p).steps)
        except Timeout:
            raise
        except Exception as ex:
            return "TWIN RAISED", 0, f"{type(ex).__name__}: {str(ex)[:300]}"
    c = Run("replay", p)
    try:
        fn(c)
    except rk.ReplayError as ex:
        n, i = c.info()
        return p.labels.clear, n, f"ReplayError: {str(ex)[:300]} | {i}"
    except Timeout:
        raise
    except Exception as ex:
        n, i = c.info()
        tb = " / ".join(traceback.format_exc().splitlines()[-6:])
        return p.labels.unclear, n, f"{type(ex).__name__}: {str(ex)[:300]} | {i} | {tb}"
    finally:
        c.release()
    diff = compare(plain.steps, c.steps)
    n, i = c.info()
    if twin_diff is not None:
        return "SILENT (twin != plain)", n, f"twin: {twin_diff} | replay: {diff} | {i}"
    if diff is not None:
        return p.labels.silent, n, f"{diff} | {i}"
    return (p.labels.replayed if n > 0 else p.labels.exact), n, i


def run_pattern(
    name: str,
    fn: Callable,
    profile: Profile = ROUND9,
    *,
    timeout: int | None = None,
    within: contextlib.AbstractContextManager | None = None,
) -> tuple[str, int, str]:
    """(verdict, replays, detail) of pattern ``fn``, under ``within`` (a setting) if given.

    ``name`` is the caller's label (the call form every round uses); ``timeout`` overrides the
    profile's for a pattern known to be slow."""
    del name
    timeout = timeout or profile.timeout
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        with within if within is not None else contextlib.nullcontext():
            return _verdict(fn, profile)
    except Timeout:
        return "TIMEOUT", 0, f"hang > {timeout}s"
    finally:
        signal.alarm(0)
        if profile.collect:
            gc.collect()


@contextlib.contextmanager
def storage_swap(on: bool) -> Iterator[None]:
    """With torch's storage swap (this torch) or without it, as on torch 2.11 where the recorder
    gives a held ``.grad`` buffer away (``copy_out._swap = None``, the project's own emulation)."""
    saved = copy_out._swap
    copy_out._swap = saved if on else None
    try:
        yield
    finally:
        copy_out._swap = saved


# ------------------------------------------------------------------------------ the table
class Patterns(dict):
    """name -> ``fn(run)``, in the order registered: the order of the table."""

    def reg(self, name: str, fn: Callable, **kw) -> None:
        """One pattern from a shared body and the values that make it this one."""
        self[name] = functools.partial(fn, **kw)

    def pattern(self, name: str) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            self[name] = fn
            return fn

        return deco


def data(seed: int, *shapes) -> list[torch.Tensor]:
    """Standard-normal tensors of ``shapes`` from ``seed``: the same inputs in both arms."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def select(patterns: dict[str, Callable], argv: list[str]) -> list[str]:
    """The patterns whose name starts with one of ``argv`` (all without arguments)."""
    return [n for n in patterns if not argv or any(n.startswith(a) for a in argv)]


def run_table(
    patterns: dict[str, Callable],
    argv: list[str],
    *,
    profile: Profile = ROUND9,
    name_width: int = 44,
    detail_cap: int | None = 400,
) -> list[tuple[str, str, int, str]]:
    """Run the selected patterns, one row each, then a SUMMARY line of verdict counts."""
    sel = select(patterns, argv)
    rows, counts = [], {}
    t0 = time.time()
    for name in sel:
        t = time.time()
        verdict, n, detail = run_pattern(name, patterns[name], profile)
        counts[verdict] = counts.get(verdict, 0) + 1
        rows.append((name, verdict, n, detail))
        print(
            f"{name:{name_width}s} | {verdict:16s} | {n:3d} | {time.time() - t:5.1f}s | "
            f"{detail[:detail_cap]}",
            flush=True,
        )
    print(f"\nSUMMARY {len(sel)} patterns in {time.time() - t0:.0f}s: {counts}")
    return rows
