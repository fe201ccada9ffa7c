"""The recording call runs the step's Python more than once (probe, eager reference, capture, a
retry): what those extra runs change outside the model's tensors must be put back, so the call
leaves exactly what one eager call leaves, whatever its outcome.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn

from ...verify.weight_caches import FREES_HELD_CASTS
from .pattern import MLP, Arm, Extras, Pattern, loop, mlp, sgd, step_loop
from .under_capture import CaptureAware
from .writing import HazardClass, Train, built, looped, stepped

HAZARD = "recording_call"
HC = HazardClass(HAZARD)


class CentredHead(MLP):
    """DINO's head: a centre buffer re-bound in forward (``self.center = m * self.center + ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.center = 0.9 * self.center + 0.1 * out.detach().mean(0)
        return out - self.center


def _centred(device: str) -> nn.Module:
    return CentredHead().to(device)


# --------------------------------------------------------------------------- what loss_fn holds
def _ema_target(model: nn.Module, arm: Arm) -> Extras:
    """BYOL: a target network, an EMA of the online one, updated inside loss_fn."""
    target = copy.deepcopy(model).requires_grad_(False)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for t, p in zip(target.parameters(), m.parameters(), strict=True):
                t.mul_(0.9).add_(p, alpha=0.1)
        return (m(x) - target(x)).pow(2).mean()

    kept = step_loop(model, arm, loss_fn=loss_fn, steps=4)
    kept.update({f"target/{n}": t for n, t in target.named_parameters()})
    return kept


def _teacher_bn(model: nn.Module, arm: Arm, **step_kwargs: object) -> Extras:
    """Distillation from a teacher left in train mode: its BatchNorm statistics move every call."""
    teacher = MLP(bn=True).to(arm.device).requires_grad_(False)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = teacher(x)
        return (m(x) - soft).pow(2).mean()

    kept = step_loop(model, arm, loss_fn=loss_fn, steps=4, **step_kwargs)
    kept.update({f"teacher/{n}": b for n, b in teacher.named_buffers()})
    return kept


class DinoLoss(nn.Module):
    """DINO's loss: centres the teacher's output with a buffer it updates in place each call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(3))

    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = torch.softmax(teacher - self.center, dim=1)
            self.center.mul_(0.9).add_(teacher.mean(0), alpha=0.1)
        return -(target * torch.log_softmax(student, dim=1)).sum(1).mean()


def _dino_loss(model: nn.Module, arm: Arm) -> Extras:
    criterion = DinoLoss().to(arm.device)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return criterion(m(x), m(x.flip(0)).detach())

    kept = step_loop(model, arm, loss_fn=loss_fn, steps=4)
    kept["loss_centre"] = criterion.center
    return kept


# --------------------------------------------------------------------------- the optimizer's Python
class CountingSGD(torch.optim.SGD):
    """A Lookahead-style counter kept in the param group: every second step pulls the weights back."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = super().step(closure)
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            if group["k"] % 2 == 0:
                for p in group["params"]:
                    p.mul_(0.5)
        return loss


def _counter_failed_verification(model: nn.Module, arm: Arm) -> Extras:
    """The recording differs from eager (a capture-time branch): the call falls back to eager, the
    counter must have moved once."""
    kept = step_loop(
        model,
        arm,
        optimizer=lambda m: CountingSGD(m.parameters(), lr=0.1),
        steps=5,
        trust_optimizer=True,  # its step launches kernels; the counter is a param-group value (keyed)
    )
    opt = arm.optimizers[-1]
    kept["counter"] = torch.tensor(float(opt.param_groups[0]["k"]))
    return kept


# --------------------------------------------------------------------------- output
class Printing(MLP):
    """Prints from forward (a debugging line, a progress counter)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forward", tuple(x.shape))
        return super().forward(x)


def _printing(device: str) -> nn.Module:
    return Printing().to(device)


def _counted(
    arm: Arm, calls: int, one_call, stream: str = "stdout", log: list | None = None
) -> Extras:
    """Runs ``one_call(i)`` ``calls`` times; every call that did not replay (a replay runs no
    Python) must print exactly once, as eager's does: kept is how many lines they printed too
    many or too few. ``stream``: where forward prints (``stdout``, ``stderr``); ``log``: the
    warnings recorded meanwhile (forward warns once per call too)."""
    wrong = 0
    redirect = contextlib.redirect_stderr if stream == "stderr" else contextlib.redirect_stdout
    for i in range(calls):
        replays, warned = _replays(arm), _warned(log)
        out = io.StringIO()
        with redirect(out):
            one_call(i)
        if _replays(arm) == replays:
            wrong += abs(out.getvalue().count("forward") - 1)
            if log is not None:
                wrong += abs(_warned(log) - warned - 1)
    return {"prints_not_once": torch.tensor(float(wrong))}


def _warned(log: list | None) -> int:
    """How many of forward's warnings ``log`` holds (not replaykit's own)."""
    return sum("forward warns" in str(w.message) for w in log or ())


def _replays(arm: Arm) -> int:
    return 0 if arm.recorder is None else arm.recorder.counts["replay"]


def _print_capture(
    model: nn.Module, arm: Arm, stream: str = "stdout", log: list | None = None
) -> Extras:
    opt = sgd(model)

    def one(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        model(arm.randn(4, 6)).pow(2).mean().backward()
        opt.step()

    return _counted(arm, 4, one, stream, log)


def _print_step(
    model: nn.Module, arm: Arm, stream: str = "stdout", log: list | None = None
) -> Extras:
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), sgd(model))
    return _counted(arm, 4, lambda i: step(arm.randn(4, 6)), stream, log)


class PrintingToStderr(MLP):
    """Prints to ``sys.stderr`` from forward, and warns there (``warnings``' ``always`` filter)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forward", tuple(x.shape), file=sys.stderr)
        warnings.warn("forward warns", UserWarning, stacklevel=1)
        return super().forward(x)


def _stderr_capture(model: nn.Module, arm: Arm) -> Extras:
    with warnings.catch_warnings(record=True) as log:
        warnings.filterwarnings("always", "forward warns")
        return _print_capture(model, arm, "stderr", log)


def _stderr_step(model: nn.Module, arm: Arm) -> Extras:
    with warnings.catch_warnings(record=True) as log:
        warnings.filterwarnings("always", "forward warns")
        return _print_step(model, arm, "stderr", log)


# --------------------------------------------------------------------------- class attributes, iterators
class ClassCounting(MLP):
    """Counts its calls in a class attribute (``type(self).calls += 1``): a trainer's global step."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


def _class_counting(device: str) -> nn.Module:
    ClassCounting.calls = 0  # each arm starts from none
    return ClassCounting().to(device)


def _class_calls(extras: Extras) -> Extras:
    return {**extras, "class_calls": torch.tensor(float(ClassCounting.calls))}


IDS = itertools.count()  # a module-level iterator code draws ids from


class Ticking(MLP):
    """Draws an id per call from a module-level ``itertools.count`` (``next(IDS)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        next(IDS)
        return super().forward(x)


def _ticking(device: str) -> nn.Module:
    global IDS
    IDS = itertools.count()  # each arm starts from 0
    return Ticking().to(device)


def _drawn(extras: Extras) -> Extras:
    """How far the iterator moved (the next id: drawn here, after the arm's last call)."""
    return {**extras, "ids_drawn": torch.tensor(float(next(IDS)))}


def _ticking_loss_fn(model: nn.Module, arm: Arm) -> Extras:
    global IDS
    IDS = itertools.count()

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        next(IDS)
        return m(x).pow(2).mean()

    return _drawn(step_loop(model, arm, loss_fn=loss_fn, steps=4))


# --------------------------------------------------------------------------- the forward's globals
_TOTAL = torch.zeros(3)  # a running total the forward adds to (re-made on the arm's device by make)
_SCALE = torch.tensor(1.0)  # a schedule the training script re-binds between steps
_STATS: dict[str, int] = {"calls": 0}  # a global dict the forward counts its calls in


class GlobalTotal(MLP):
    """Adds its batch mean to a module-level tensor in place (a global statistic)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        with torch.no_grad():
            _TOTAL.add_(out.detach().mean(0))
        return out


class GlobalScale(MLP):
    """Scales by a module-level tensor that the script re-binds each step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * _SCALE


class GlobalCount(MLP):
    """Counts its calls in a module-level dict, and scales by the count (a warm-up ramp)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _STATS["calls"] += 1
        return super().forward(x) * min(_STATS["calls"], 3)


def _globals_made(cls: type[MLP]) -> Callable[[str], nn.Module]:
    def make(device: str) -> nn.Module:
        global _TOTAL, _SCALE
        _TOTAL, _SCALE = torch.zeros(3, device=device), torch.tensor(1.0, device=device)
        _STATS["calls"] = 0
        return cls().to(device)

    return make


def _rebind_scale(device: str, i: int) -> None:
    global _SCALE
    _SCALE = torch.tensor(1.0 + i, device=device)


def _global_kept(kept: Extras) -> Extras:
    return {**kept, "global_total": _TOTAL.clone(), "calls": torch.tensor(float(_STATS["calls"]))}


def _global_capture(model: nn.Module, arm: Arm) -> Extras:
    before = lambda m, i: _rebind_scale(arm.device, i)  # noqa: E731
    return _global_kept(loop(model, arm, steps=4, before=before))


def _global_step(model: nn.Module, arm: Arm) -> Extras:
    before = lambda m, o, i: _rebind_scale(arm.device, i)  # noqa: E731
    return _global_kept(step_loop(model, arm, steps=4, before=before))


def _forward_globals() -> list[Pattern]:
    """Each forward above, under both entry points; what protects it: the call state puts back the
    total the extra runs add to, ``forward_inputs`` keys the re-bound tensor and sees the count."""
    cases = [
        ("global_total", "adds to a module-level tensor in place", GlobalTotal, "call_state"),
        (
            "global_rebound",
            "reads a module-level tensor re-bound each step",
            GlobalScale,
            "forward_inputs",
        ),
        ("global_dict", "counts its calls in a module-level dict", GlobalCount, "forward_inputs"),
    ]
    return [
        HC.pattern(
            f"{prefix}forward_{name}",
            f"forward {what}{suffix}",
            _globals_made(cls),
            train,
            guard=guard,
            api=api,
        )
        for name, what, cls, guard in cases
        for prefix, suffix, train, api in (
            ("", "", _global_capture, "capture"),
            ("step_", ", whole step", _global_step, "step"),
        )
    ]


class _UnitRows(nn.Module):
    """A parametrization: each row of the weight scaled to unit norm."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w / w.norm(dim=1, keepdim=True)


def _parametrized(device: str) -> nn.Module:
    model = mlp()(device)
    nn.utils.parametrize.register_parametrization(model.fc1, "weight", _UnitRows())
    return model


Region = Callable[[Arm], contextlib.AbstractContextManager]


def _autocast(arm: Arm) -> contextlib.AbstractContextManager:
    return torch.autocast(arm.device, dtype=torch.bfloat16)


def _in_region(region: Region, steps: int = 4) -> tuple[Train, Train]:
    """The capture loop and the whole step, each step's forward and backward inside a region the
    caller opens (``with region: loss = step(x)``), as eager opens it per step."""

    def captured(model: nn.Module, arm: Arm) -> Extras:
        opt, kept = sgd(model), {}
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            with region(arm):
                loss = model(arm.randn(4, 6)).float().pow(2).mean()
                loss.backward()
            opt.step()
            kept[f"loss{i}"] = loss.detach()
        return kept

    def stepped_(model: nn.Module, arm: Arm) -> Extras:
        step = arm.train_step(model, lambda m, x: m(x).float().pow(2).mean(), sgd(model))
        kept = {}
        for i in range(steps):
            with region(arm):
                kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
        return kept

    return captured, stepped_


PATTERNS: list[Pattern] = [
    HC.pattern(  # rk.capture: its recordings keep autocast's cache off themselves (backends)
        "step_autocast_region_per_step",
        "each step inside the caller's torch.autocast(bfloat16), its weight-cast cache on, whole step",
        mlp(),
        _in_region(_autocast)[1],
        guard="call_state",
        api="step",
        unsafe_never=(
            "torch < 2.5 runs it eagerly (autocast_region)" if FREES_HELD_CASTS else None
        ),
        cpu_only="on the H200 (torch 2.11) the unsafe capture backs through the reference run's "
        "cached cast, whose node ran on the legacy stream: the capture fails ('would make the "
        "legacy stream depend on a capturing blocking stream') and the step retires, exact",
    ),
    *HC.twins(
        "parametrize_cached_region",
        "a parametrized weight, each step's forward and backward inside parametrize.cached()",
        _parametrized,
        *_in_region(lambda arm: nn.utils.parametrize.cached()),
        guard="call_state",
    ),
    *HC.twins(
        "rebound_centre_buffer",
        "DINO's head re-binds a centre buffer in forward (self.center = m * self.center + ...)",
        _centred,
        looped(steps=4),
        stepped(steps=4),
        step_what="DINO's head re-binds a centre buffer in forward, whole step",
        step=dict(
            unsafe_never="the centre is a state: the recording reads it from a slot fed before each replay, which no switch turns off"
        ),
        guard="call_state",
    ),
    HC.pattern(
        "step_ema_target_in_loss_fn",
        "a BYOL target network, EMA of the online one, updated inside loss_fn",
        mlp(),
        _ema_target,
        guard="call_state",
        api="step",
        cpu_only="a CUDA capture runs no kernel, so without the call state only the eager reference "
        "moves the target before the replay: on the H200 the unguarded arm replayed bitwise "
        "(measured); the emulated capture executes, moving it twice",
    ),
    HC.pattern(
        "step_teacher_bn_in_loss_fn",
        "a distillation teacher with BatchNorm, left in train mode, run inside loss_fn",
        mlp(),
        _teacher_bn,
        guard="call_state",
        api="step",
    ),
    HC.pattern(
        "step_teacher_bn_in_loss_fn_checked",
        "the same teacher, every replay shadow-checked (check_every=1): replay, then eager again",
        mlp(),
        lambda m, a: _teacher_bn(m, a, check_every=1),
        guard="call_state",
        api="step",
    ),
    HC.pattern(
        "step_dino_loss_centre",
        "DINO's loss module, held by loss_fn, updates its centre buffer in place",
        mlp(),
        _dino_loss,
        guard="call_state",
        api="step",
    ),
    HC.pattern(
        "step_param_group_counter_failed_verification",
        "an optimizer counts steps in its param group; the recording fails verification",
        built(CaptureAware),
        _counter_failed_verification,
        guard="call_state",
        api="step",
    ),
    *HC.twins(
        "print_in_forward",
        "forward prints: the recording call prints once, as an eager call",
        _printing,
        _print_capture,
        _print_step,
        step_what="forward prints: the whole step's recording call prints once, as an eager call",
        guard="call_state",
    ),
    *_forward_globals(),
    *HC.twins(
        "stderr_and_warning_in_forward",
        "forward prints to sys.stderr and warns: the recording call shows them once, as an eager call",
        built(PrintingToStderr),
        _stderr_capture,
        _stderr_step,
        step_what="forward prints to sys.stderr and warns, whole step: shown once by the recording call",
        guard="call_state",
    ),
    *HC.twins(
        "class_counter_in_forward",
        "forward counts its calls in a class attribute (type(self).calls += 1)",
        _class_counting,
        lambda m, a: _class_calls(loop(m, a, steps=4)),
        lambda m, a: _class_calls(step_loop(m, a, steps=4)),
        step_what="forward counts its calls in a class attribute, whole step",
        step=dict(
            unsafe_never="the step's eager reference sees the class attribute change first and stands as the call"
        ),
        guard="call_state",
    ),
    *HC.twins(
        "iterator_in_forward",
        "forward draws an id from a module-level itertools.count (next(IDS))",
        _ticking,
        lambda m, a: _drawn(loop(m, a, steps=4)),
        lambda m, a: _drawn(step_loop(m, a, steps=4)),
        step_what="forward draws an id from a module-level itertools.count, whole step",
        guard="call_state",
    ),
    HC.pattern(
        "step_iterator_in_loss_fn",
        "loss_fn draws an id from a module-level itertools.count",
        mlp(),
        _ticking_loss_fn,
        guard="call_state",
        api="step",
    ),
]
