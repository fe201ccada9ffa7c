"""A module holding a plain object that refers to itself (a config whose ``owner`` is itself, a
trainer and its module: what configs and trainers often hold) raised a bare ``RecursionError``
from the user's own call under both entry points (hostile round 8). Such an object is keyed by
identity, as the code guard keys a value it cannot key, and warned of once; the calls replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

from ._same import same


class Config:
    def __init__(self) -> None:
        self.owner = self  # a back-reference
        self.items = [self]


def _net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.cfg = Config()
    return model


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


def _loop(model: nn.Module, step: rk.TrainStep | None = None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    seen = []
    for _ in range(5):
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        if step is not None:
            step(x, y)
        else:
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


def test_a_self_referring_object_on_the_module_replays_under_capture() -> None:
    eager = _loop(_net())
    model = _net()
    rec = rk.capture(model, backend="emulated")
    with pytest.warns(rk.ReplayWarning, match="refers to itself"):
        seen = _loop(model)
    assert same(seen, eager)
    assert rec.counts["replay"] >= 2, rec.summary()


def test_a_self_referring_object_on_the_module_replays_in_a_step() -> None:
    model = _net()
    eager = _loop(
        model, rk.TrainStep(model, _loss, torch.optim.SGD(model.parameters(), lr=0.1), replay=False)
    )
    model = _net()
    step = rk.TrainStep(
        model, _loss, torch.optim.SGD(model.parameters(), lr=0.1), backend="emulated"
    )
    assert same(_loop(model, step), eager)
    assert step.counts["replay"] >= 2, step.summary()
