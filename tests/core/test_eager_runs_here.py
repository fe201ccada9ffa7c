"""What eager runs must not crash under replay (issue #33, class 4): it replays exactly, runs eagerly
with a reason, or raises a clear ReplayError."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import replaykit as rk


def _capture_step(model: nn.Module, unsafe: tuple[str, ...] = ()) -> tuple[Callable, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec = rk.capture(model, backend="emulated", unsafe_disable=unsafe)

    def step(*args: object) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(*args).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step, rec


def _train_step(model: nn.Module, unsafe: tuple[str, ...] = ()) -> tuple[Callable, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(
        model,
        lambda m, *a: m(*a).square().mean(),
        opt,
        backend="emulated",
        unsafe_disable=unsafe,
    )
    return (lambda *a: step(*a).detach()), step


def _eager_step(model: nn.Module) -> Callable:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(*args: object) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(*args).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


ENTRIES = {"capture": _capture_step, "step": _train_step}


def _state(model: nn.Module, losses: list[torch.Tensor]) -> list[torch.Tensor]:
    return [*losses, *(t.detach().clone() for t in model.state_dict().values())]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- numpy scalar attribute
class ScheduledDrop(nn.Module):
    """A DropBlock-like rate set from a numpy schedule: ``self.p = np.linspace(0, .3, 10)[i]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.p = np.linspace(0, 0.3, 10)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(1 - self.p)


def _scheduled(model: ScheduledDrop, step: Callable) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    schedule = np.linspace(0, 0.3, 10)
    losses = []
    for i in range(6):
        model.p = schedule[min(i, 3)]  # a numpy scalar, changing, then held
        losses.append(step(torch.randn(4, 6, generator=g)))
    return _state(model, losses)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_numpy_scalar_attribute_is_keyed_not_restored_in_place(entry: str) -> None:
    torch.manual_seed(0)
    eager, model = ScheduledDrop(), ScheduledDrop()
    model.load_state_dict(eager.state_dict())
    reference = _scheduled(eager, _eager_step(eager))
    step, rec = ENTRIES[entry](model)
    replayed = _scheduled(model, step)
    assert _same(reference, replayed)
    assert rec.counts["replay"] >= 1, rec.summary()  # the held rate replays
    rec.release()
