"""What code reads that a graph would freeze, found by hostile round 13.

- torch's objects holding a schedule: ``sched.last_epoch`` or ``opt.param_groups[0]["lr"]`` read
  by ``loss_fn`` or a forward (keyed by identity, they replayed the recording call's value);
- a function's own attributes (``lf.aux = 0.5`` set by the loop, ``lf.calls += 1``): neither
  keyed nor put back between the recording call's runs;
- a callable criterion's class attributes (``Focal.gamma`` changed by the loop);
- an environment variable (``os.environ``) or a ``ContextVar`` the loop sets.

Each runs an eager loop and the same loop through replaykit from one seed, compared bitwise;
its unsafe arm (the guard switched off) must differ.
"""

from __future__ import annotations

import contextvars
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import replaykit as rk

from ._same import same

STEPS = 6
ON = {"device": "cpu"}  # the device of the test running now (the eager arm has no backend)


@pytest.fixture(autouse=True)
def _on_device(device: str) -> None:
    ON["device"] = device


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(ON["device"])


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(STEPS)
    ]
    return [(x.to(ON["device"]), y.to(ON["device"])) for x, y in batches]


def _loop(
    setup: Callable[
        [nn.Module, torch.optim.Optimizer], tuple[Callable[..., Any], Callable[[int], None]]
    ],
    entry: str,
    backend: str | None,
    unsafe: tuple[str, ...] = (),
) -> list[Any]:
    """``setup(model, opt)`` gives ``loss_fn`` and what the loop does before step ``i``."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn, before = setup(model, opt)
    step = None
    if backend is not None and entry == "step":
        step = rk.TrainStep(model, loss_fn, opt, backend=backend, unsafe_disable=unsafe)
    elif backend is not None:
        rk.capture(model, backend=backend, unsafe_disable=unsafe)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(_batches()):
            before(i)
            if step is not None:
                losses.append(step(x, y))
            else:
                loss = loss_fn(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
    return [*model.state_dict().values(), *losses]


def _scheduler_epoch(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ramp = min(1.0, sched.last_epoch / 4)  # an auxiliary loss ramped in by the schedule
        out = m(x)
        return (out - y).pow(2).mean() + ramp * out.pow(2).mean()

    return loss_fn, lambda i: sched.step() if i else None


def _float_lr_read(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = m(x)  # an L2 term scaled by the learning rate in use
        return (out - y).pow(2).mean() + opt.param_groups[0]["lr"] * out.pow(2).mean()

    def before(i: int) -> None:
        opt.param_groups[0]["lr"] = 0.1 / (1 + i)

    return loss_fn, before


def _function_attribute(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return (out - y).pow(2).mean() + loss_fn.aux * out.pow(2).mean()

    loss_fn.aux = 0.0  # type: ignore[attr-defined]

    def before(i: int) -> None:
        if i == 3:
            loss_fn.aux = 0.5  # type: ignore[attr-defined]

    return loss_fn, before


class Focal:
    """A callable criterion whose class default the script anneals (``Focal.gamma = ...``)."""

    gamma = 0.0

    def __call__(self, m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return (out - y).pow(2).mean() + type(self).gamma * out.pow(2).mean()


def _class_default(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    Focal.gamma = 0.0

    def before(i: int) -> None:
        if i == 3:
            Focal.gamma = 0.5

    return Focal(), before


TEMPERATURE: contextvars.ContextVar[float] = contextvars.ContextVar("temperature", default=1.0)


def _environment_flag(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    os.environ["RK_TEST_TEMPERATURE"] = "1.0"

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (m(x) / float(os.environ["RK_TEST_TEMPERATURE"]) - y).pow(2).mean()

    def before(i: int) -> None:
        if i == 3:
            os.environ["RK_TEST_TEMPERATURE"] = "2.0"

    return loss_fn, before


def _context_variable(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    TEMPERATURE.set(1.0)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (m(x) / TEMPERATURE.get() - y).pow(2).mean()

    return loss_fn, lambda i: TEMPERATURE.set(2.0) if i == 3 else None


CASES = {
    "environment_flag": _environment_flag,
    "context_variable": _context_variable,
    "scheduler_epoch": _scheduler_epoch,
    "float_lr_read": _float_lr_read,
    "function_attribute": _function_attribute,
    "class_default": _class_default,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_reads_schedule(backend: str, case: str) -> None:
    eager = _loop(CASES[case], "step", None)
    assert same(eager, _loop(CASES[case], "step", backend))
    assert not same(eager, _loop(CASES[case], "step", backend, ("loss_inputs",)))


class ScheduledNet(nn.Module):
    """A forward that reads a scheduler it holds, and a helper's function attribute."""

    def __init__(self, sched: Any) -> None:
        super().__init__()
        self.net = _net()
        self.sched = sched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(self.net(x)) * (1.0 + self.sched.last_epoch)


def _scaled(h: torch.Tensor) -> torch.Tensor:
    return h * _scaled.scale  # type: ignore[attr-defined]


def _capture_loop(backend: str | None, unsafe: tuple[str, ...] = ()) -> list[Any]:
    _scaled.scale = 1.0  # type: ignore[attr-defined]
    holder = nn.Linear(1, 1)  # the scheduler's own optimizer, outside the captured model
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(holder.parameters(), lr=0.1), 1)
    model = ScheduledNet(sched).to(ON["device"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if backend is not None:
        rk.capture(model, backend=backend, unsafe_disable=unsafe)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(_batches()):
            if i in (2, 4):
                sched.step()
            if i == 3:
                _scaled.scale = 0.5  # type: ignore[attr-defined]
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            kept.append(loss.detach())
    return [*model.state_dict().values(), *kept]


def test_forward_reads_scheduler_and_function_attribute(backend: str) -> None:
    eager = _capture_loop(None)
    assert same(eager, _capture_loop(backend))
    assert not same(eager, _capture_loop(backend, ("module_state", "forward_inputs")))


def test_function_attribute_counter_counts_once_per_call(backend: str) -> None:
    """``lf.calls += 1``: the recording call's extra runs are put back, so the count is eager's."""

    def run(replay: bool, unsafe: tuple[str, ...] = ()) -> int:
        def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss_fn.calls += 1  # type: ignore[attr-defined]
            return (m(x) - y).pow(2).mean()

        loss_fn.calls = 0  # type: ignore[attr-defined]
        _loop(lambda m, o: (loss_fn, lambda i: None), "step", backend if replay else None, unsafe)
        return loss_fn.calls  # type: ignore[attr-defined]

    assert run(True) == run(False) == STEPS
    assert run(True, ("call_state", "loss_inputs")) != STEPS
