"""TrainStep's ``side_effects`` protection: a step whose Python writes what a replay would not
(an input in place, a model attribute, a dict the model holds) retires, exactly; switched off,
the replays skip those writes and the run differs from eager.

The step trains on one batch repeatedly, so a write a replay skips changes every later step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control
from replaykit.verify.bitwise import diff_states

Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _writes_input(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x.mul_(0.5)  # the caller's batch: eager halves it every step
    return m(x).pow(2).mean()


def _assigns_attribute(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    m.scale = 3.0 - m.scale  # a float on the model, alternating 2, 1, 2...: the step reads it
    return m(x).pow(2).mean() * m.scale


def _changes_held_dict(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    m.history["task"] = 1 - m.history["task"]  # a task flag the model holds, alternating
    return m(x).pow(2).mean() * (1.0 + m.history["task"])


WRITES: dict[str, Loss] = {
    "input": _writes_input,
    "attribute": _assigns_attribute,
    "held_dict": _changes_held_dict,
}


def _train(
    loss_fn: Loss, replay: bool, device: str, backend: str, unsafe: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor | None], rk.TrainStep]:
    """Six steps on one batch; the end state: parameters, losses, the batch, the model's host values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    model.scale, model.history = 1.0, {"task": 0}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(
        model, loss_fn, opt, replay=replay, backend=backend, warmup=1, unsafe_disable=unsafe
    )
    x = torch.randn(4, 6, device=device)
    try:
        state: dict[str, torch.Tensor | None] = {f"loss{i}": step(x).detach() for i in range(6)}
    finally:
        step.release()
    state |= {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    state["batch"] = x
    state["scale"] = torch.tensor(model.scale, dtype=torch.float64)
    state["task"] = torch.tensor(model.history["task"])
    return state, step


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_step_that_writes_retires_and_ends_like_eager(backend: str, device: str, write: str):
    eager, _ = _train(WRITES[write], False, device, backend)
    replayed, step = _train(WRITES[write], True, device, backend)
    assert diff_states(eager, replayed) == [], step.journal
    assert step.retired and "a replay would" in step.retire_reason, step.retire_reason
    assert step.counts["replay"] == 0


@pytest.mark.parametrize("write", sorted(WRITES))
def test_without_side_effects_a_step_that_writes_differs(backend: str, device: str, write: str):
    """The negative control: with the check off the write is recorded once and replays skip it."""
    eager, _ = _train(WRITES[write], False, device, backend)
    unsafe, step = _train(WRITES[write], True, device, backend, negative_control("side_effects"))
    assert diff_states(eager, unsafe) != [], step.journal
    assert step.counts["replay"] > 0 and not step.retired


def test_without_side_effects_host_rng_still_retires(backend: str, device: str):
    """The switch covers the writes only: a draw from Python's random is host_rng's, still on."""

    def draws(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).pow(2).mean() * random.random()

    random.seed(0)
    eager, _ = _train(draws, False, device, backend)
    random.seed(0)
    replayed, step = _train(draws, True, device, backend, negative_control("side_effects"))
    assert diff_states(eager, replayed) == [], step.journal
    assert step.retired and "Python's random" in step.retire_reason, step.retire_reason
