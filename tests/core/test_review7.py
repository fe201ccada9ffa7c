"""Review of issue #33 (a call that runs eagerly leaves exactly what eager leaves), as a user breaks it.

Each test trains a few steps with replaykit and with a plain eager loop from the same state and
compares what the user can see. The ``xfail(strict=True)`` ones are open findings: each fails today
(a silent difference: no eager reason, no retirement) and turns the suite red once fixed, so the
mark must then be removed.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk

STEPS = 5
TOTAL = torch.zeros(2)  # a module-level tensor the forward adds to (a global statistic)
STATS: dict[str, int] = {"calls": 0}  # a module-level dict the forward counts in
TICKS = itertools.count()  # a module-level iterator the forward draws ids from


class _Net(nn.Linear):
    """``nn.Linear(4, 2)`` whose forward has one host-side effect, chosen by ``kind``."""

    calls = 0  # a class attribute the forward counts in

    def __init__(self, kind: str) -> None:
        super().__init__(4, 2)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "global_tensor":
            with torch.no_grad():
                TOTAL.add_(1.0)
        elif self.kind == "global_dict":
            STATS["calls"] += 1
        elif self.kind == "class_attr":
            type(self).calls += 1
        elif self.kind == "stderr":
            print("forward", file=__import__("sys").stderr)
        return super().forward(x)


class _Ticking(_Net):
    """Draws an id from the module-level iterator (its own class: code that names an iterator
    runs eagerly whatever it does, so ``_Net``'s other kinds must not name one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        next(TICKS)
        return super().forward(x)


def _seen(kind: str) -> object:
    """What the forward's effect left, read the way the user reads it."""
    return {
        "global_tensor": lambda: TOTAL.clone(),
        "global_dict": lambda: STATS["calls"],
        "class_attr": lambda: _Net.calls,
        "iterator": lambda: repr(TICKS),
    }.get(kind, lambda: None)()


def _reset() -> None:
    global TICKS
    TOTAL.zero_()
    STATS["calls"] = 0
    _Net.calls = 0
    TICKS = itertools.count()


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).square().mean()


def _train(kind: str, entry: str) -> tuple[list, str]:
    """Per call: (what the effect left, stderr lines); ``entry``: eager, step or capture."""
    _reset()
    torch.manual_seed(0)
    model = (_Ticking if kind == "iterator" else _Net)(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    run: Callable[[torch.Tensor], object]
    rec = None
    if entry == "step":
        rec = rk.TrainStep(model, _loss, opt, backend="emulated")
        run = rec
    else:
        if entry == "capture":
            rec = rk.capture(model, backend="emulated")

        def run(x: torch.Tensor) -> None:
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad()

    seen = []
    for i in range(STEPS):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            run(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)))
        seen.append((_seen(kind), err.getvalue().count("forward")))
    summary = rec.summary() if rec is not None else "eager"
    if entry == "capture":
        rec.release()
    return seen, summary


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) if isinstance(x[0], torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", rk.ReplayWarning)


SILENT = "silent: {}; no eager reason, no retirement (review7)"


@pytest.mark.parametrize("entry", ["step", "capture"])
def test_global_tensor_updated_in_forward_moves_once_per_call(entry: str) -> None:
    eager, _ = _train("global_tensor", "eager")
    got, summary = _train("global_tensor", entry)
    assert _same(got, eager), (got, eager, summary)


def test_global_dict_counted_in_forward_step() -> None:
    eager, _ = _train("global_dict", "eager")
    got, summary = _train("global_dict", "step")
    assert _same(got, eager), (got, eager, summary)


def test_global_dict_counted_in_forward_capture_is_exact() -> None:
    """Under capture the global's value keys the recordings: exact (one recording per call)."""
    eager, _ = _train("global_dict", "eager")
    got, _ = _train("global_dict", "capture")
    assert _same(got, eager)


@pytest.mark.parametrize("entry", ["step", "capture"])
def test_class_attribute_counted_in_forward(entry: str) -> None:
    eager, _ = _train("class_attr", "eager")
    got, summary = _train("class_attr", entry)
    assert _same(got, eager), (got, eager, summary)


@pytest.mark.parametrize("entry", ["step", "capture"])
def test_iterator_drawn_in_forward(entry: str) -> None:
    eager, _ = _train("iterator", "eager")
    got, summary = _train("iterator", entry)
    assert _same(got, eager), (got, eager, summary)


@pytest.mark.parametrize("entry", ["step", "capture"])
def test_stderr_printed_once_by_the_recording_call(entry: str) -> None:
    got, summary = _train("stderr", entry)
    assert max(n for _, n in got) == 1, (got, summary)


class _SlowSGD(torch.optim.SGD):
    """SGD that pulls slow weights it holds (an attribute, not ``state``) towards the parameters:
    its step only launches kernels, so ``trust_optimizer=True`` is honest."""

    def __init__(self, params: object, **kw: object) -> None:
        super().__init__(params, **kw)
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: object = None) -> object:
        out = super().step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        torch._foreach_lerp_(self.slow, params, 0.5)
        return out


@pytest.mark.parametrize("unsafe", [(), ("call_state",)], ids=["safe", "unsafe"])
def test_trusted_optimizer_tensor_attribute_moves_once_per_call(unsafe: tuple) -> None:
    """Slow weights a trusted optimizer holds outside ``.state`` (Lookahead, SWA) are lerped by the
    reference and the capture of the recording call: the call state puts them back in between
    (fixed in review7); with ``call_state`` off they move twice."""
    ends = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = _SlowSGD(model.parameters(), lr=0.1)
        step = rk.TrainStep(
            model,
            _loss,
            opt,
            backend="emulated",
            trust_optimizer=True,
            replay=replay,
            unsafe_disable=unsafe if replay else (),
        )
        for i in range(3):
            step(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)))
        ends.append((opt.slow, model.weight.detach().clone(), step.counts["replay"]))
    (eager_slow, eager_w, _), (slow, w, replays) = ends
    assert replays >= 1 and torch.equal(w, eager_w)
    same = all(torch.equal(a, b) for a, b in zip(slow, eager_slow, strict=True))
    assert same is not bool(unsafe)


class _Counters:
    """A user's class-level counter, as a trainer keeps one."""

    seen = 0


def _loss_counting(kind: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if kind == "class_attr":
            _Counters.seen += 1
        else:
            next(TICKS)
        return _loss(m, x)

    return loss_fn


@pytest.mark.parametrize("kind", ["class_attr", "iterator"])
def test_loss_fn_counting_outside_closures(kind: str) -> None:
    ends = []
    for replay in (False, True):
        _reset()
        _Counters.seen = 0
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        step = rk.TrainStep(model, _loss_counting(kind), opt, backend="emulated", replay=replay)
        for i in range(4):
            step(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)))
        ends.append((_Counters.seen, repr(TICKS)))
    assert ends[0] == ends[1], ends


SCALE = torch.tensor(1.0)  # a module-level tensor the training script re-binds (a schedule)


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * SCALE


def _train_scaled(entry: str) -> torch.Tensor:
    global SCALE
    torch.manual_seed(0)
    model = _Scaled(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    rec = None
    if entry == "step":
        rec = rk.TrainStep(model, _loss, opt, backend="emulated")
    elif entry == "capture":
        rec = rk.capture(model, backend="emulated")
    for i in range(4):
        SCALE = torch.tensor(1.0 + i)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        if entry == "step":
            rec(x)
        else:
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad()
    if entry == "capture":
        rec.release()
    return model.weight.detach().clone()


@pytest.mark.parametrize("entry", ["step", "capture"])
def test_global_tensor_rebound_between_steps_read_in_forward(entry: str) -> None:
    assert torch.equal(_train_scaled(entry), _train_scaled("eager"))


def test_cpu_global_tensor_written_beside_a_gpu_model_routes_eager(cuda_device: str) -> None:
    """A CUDA graph does not replay a host op: a forward adding to a CPU global beside a GPU model
    must not replay (the step retires with a reason), and ends as eager."""
    global TOTAL
    ends = []
    for replay in (False, True):
        TOTAL = torch.zeros(2)
        torch.manual_seed(0)
        model = _Net("global_tensor").to(cuda_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = rk.TrainStep(model, _loss, opt, backend="cuda", replay=replay)
        for i in range(4):
            step(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(cuda_device))
        ends.append((TOTAL.clone(), model.weight.detach().cpu()))
    TOTAL = torch.zeros(2)
    assert torch.equal(ends[0][0], ends[1][0]) and torch.equal(ends[0][1], ends[1][1])
    assert step.retired and "CPU tensor" in step.summary()


def test_cpu_global_tensor_written_beside_a_gpu_module_capture(cuda_device: str) -> None:
    """The same forward under rk.capture: retired with the reason, exact."""
    global TOTAL
    ends = []
    for capture in (False, True):
        TOTAL = torch.zeros(2)
        torch.manual_seed(0)
        model = _Net("global_tensor").to(cuda_device)
        rec = rk.capture(model, backend="cuda") if capture else None
        for i in range(4):
            _loss(
                model, torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(cuda_device)
            ).backward()
        ends.append((TOTAL.clone(), model.weight.grad.cpu()))
    TOTAL = torch.zeros(2)
    assert torch.equal(ends[0][0], ends[1][0]) and torch.equal(ends[0][1], ends[1][1])
    assert rec is not None and rec.retired and "CPU tensor" in rec.summary()
    rec.release()


class _Warns(nn.Linear):
    """``nn.Linear(4, 2)`` whose forward warns (a deprecation a library issues per call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("forward warns", UserWarning, stacklevel=1)
        return super().forward(x)


@pytest.mark.parametrize("action", ["always", "default"])
@pytest.mark.parametrize("entry", ["eager", "step", "capture"])
def test_warning_in_forward_shown_as_eager_shows_it(entry: str, action: str) -> None:
    """The recording call's dropped runs' warnings are not shown and leave no registry entry:
    ``always`` shows once per call (eager's; a replay runs no Python, docs/limits.md), ``default``
    once in all (at the first call)."""
    torch.manual_seed(0)
    model = _Warns(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = rk.TrainStep(model, _loss, opt, backend="emulated") if entry == "step" else None
    rec = rk.capture(model, backend="emulated") if entry == "capture" else None
    shown = []
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("ignore", rk.ReplayWarning)
        warnings.filterwarnings(action, "forward warns")
        for i in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
            if step is not None:
                step(x)
            else:
                _loss(model, x).backward()
                opt.step()
                opt.zero_grad()
            shown.append(sum("forward warns" in str(w.message) for w in log))
    if rec is not None:
        rec.release()
    if entry == "eager" and action == "always":
        assert shown == [1, 2, 3, 4]
    elif action == "default":
        assert shown == [1, 1, 1, 1], shown
    else:  # each call that runs Python shows it once; a replay runs none
        steps = [b - a for a, b in zip([0, *shown], shown, strict=False)]
        assert shown[0] == 1 and set(steps) <= {0, 1}, shown


@pytest.mark.parametrize("entry", ["step", "capture"])
@pytest.mark.parametrize("kind", ["class_attr", "iterator"])
def test_class_attribute_and_iterator_say_why_they_run_eagerly(entry: str, kind: str) -> None:
    """Not silent: the entry point retires with the reason (an iterator before any extra run)."""
    _reset()
    model = (_Ticking if kind == "iterator" else _Net)(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if entry == "step":
        rec = rk.TrainStep(model, _loss, opt, backend="emulated")
        run = rec
    else:
        rec = rk.capture(model, backend="emulated")

        def run(x: torch.Tensor) -> None:
            _loss(model, x).backward()

    for _ in range(3):
        run(torch.randn(3, 4))
    why = rec.retire_reason or ""
    if entry == "capture":
        rec.release()
    assert ("_Net.calls" if kind == "class_attr" else "iterator") in why, why
    if kind == "iterator":
        assert next(TICKS) == 3  # one draw per call: none by an extra run
