"""Code that writes into a container the caller passes (hostile round 13): a forward's
``sink.append(...)`` or ``feats["h"] = h``, a loss_fn's ``out["loss"] = loss.detach()``.

A replay runs no Python, and a recording call runs the forward on containers rebuilt around its
static inputs: the caller's container stayed empty, even at the recording call. Such a call is
eager's alone: the signature runs eagerly (capture), the step retires (TrainStep).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import replaykit as rk

from ._same import same


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, box: Any) -> torch.Tensor:
        out = self.b(self.a(x).relu())
        if isinstance(box, list):
            box.append(out.detach().sum())
        elif isinstance(box, dict):
            box["h"] = out.detach()
        return out


def _run(
    case: str, backend: str | None, unsafe: tuple[str, ...] = (), device: str = "cpu"
) -> list[Any]:
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor, out: dict) -> torch.Tensor:
        loss = (m(x, None) - y).pow(2).mean()
        out["loss"] = loss.detach()
        return loss

    step = None
    if backend is not None and case == "step":
        step = rk.TrainStep(model, loss_fn, opt, backend=backend, unsafe_disable=unsafe)
    elif backend is not None:
        rk.capture(model, backend=backend, unsafe_disable=unsafe)
    kept: list[Any] = []
    sink: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            x, y, box = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g), {}
            x, y = x.to(device), y.to(device)
            if step is not None:
                step(x, y, box)
            elif case == "step":
                loss_fn(model, x, y, box).backward()
            else:
                held = sink if case == "list" else box
                (model(x, held) - y).pow(2).mean().backward()
            if step is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            kept.append(sorted(box.items()))
    return [*model.state_dict().values(), kept, sink]


@pytest.mark.parametrize("case", ["list", "dict", "step"])
def test_written_argument_reaches_the_caller(backend: str, device: str, case: str) -> None:
    eager = _run(case, None, device=device)
    assert same(eager, _run(case, backend, device=device))
    unsafe = "side_effects" if case == "step" else "record_probe"
    assert not same(eager, _run(case, backend, (unsafe,), device))


class Weighted(nn.Sequential):
    """A forward that reads a tag the data pipeline sets on the batch (``x.weight = 0.5``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * getattr(x, "weight", 1.0)


def _tagged_run(
    entry: str, backend: str | None, unsafe: tuple[str, ...] = (), device: str = "cpu"
) -> tuple[list, dict]:
    torch.manual_seed(0)
    model = Weighted(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (m(x) - y).pow(2).mean()

    step = None
    if backend is not None and entry == "step":
        step = rk.TrainStep(model, loss_fn, opt, backend=backend)
    elif backend is not None:
        rk.capture(model, backend=backend, unsafe_disable=unsafe)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(8):
            x, y = (
                torch.randn(5, 6, generator=g).to(device),
                torch.randn(5, 3, generator=g).to(device),
            )
            x.weight = 1.0 if i < 4 else 0.5
            if step is not None:
                step(x, y)
                continue
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    counts = step.counts if step is not None else rk.recorder_of(model).counts if backend else {}
    return list(model.state_dict().values()), dict(counts)


@pytest.mark.parametrize("entry", ["capture", "step"])
def test_a_tag_on_an_input_tensor_is_keyed(backend: str, device: str, entry: str) -> None:
    """The signature keys an input's Python attributes by value, and the static copies carry
    them: a new tag records anew, and replays."""
    eager, _ = _tagged_run(entry, None, device=device)
    replayed, counts = _tagged_run(entry, backend, device=device)
    assert same(eager, replayed)
    assert counts["replay"] >= 2 and counts["record"] >= 2  # one recording per tag, replayed
    if entry == "capture":
        assert not same(eager, _tagged_run(entry, backend, ("argument_values",), device)[0])
