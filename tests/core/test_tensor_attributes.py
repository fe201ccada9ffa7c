"""Python attributes set on a parameter or a buffer (hostile round 13): a per-parameter
``p.decay_mult`` read by ``loss_fn`` for an L2 term, a buffer's ``.temperature`` read by the
forward. A graph freezes them; the module guard keys them by value and polls them, and one set
on a tensor that had none shows in the attribute dicts' summed sizes. Changed midway, each must
record anew and train as eager; with ``module_state`` off the replay keeps the old value.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import replaykit as rk

from ._same import same


class Net(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.register_buffer("scale", torch.ones(3))
        self.scale.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale / self.scale.temperature


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    reg = sum(getattr(p, "decay_mult", 0.0) * p.pow(2).sum() for p in m.parameters())
    return (m(x) - y).pow(2).mean() + reg


def _write(model: Net, case: str) -> None:
    if case == "parameter":
        model[0].weight.decay_mult = 0.5
    elif case == "parameter_first":  # a tensor that had no attribute
        model[2].bias.decay_mult = 0.5
    else:
        model.scale.temperature = 2.0


def _train(case: str, entry: str, backend: str | None, device: str, unsafe: tuple = ()) -> Any:
    torch.manual_seed(0)
    model = Net().to(device)
    model.scale.temperature = 1.0  # .to() on a CPU model keeps the tensor; on a GPU, a new one
    for p in model[0].parameters():
        p.decay_mult = 1e-3
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = None
    if backend is not None and entry == "step":
        step = rk.TrainStep(model, _loss, opt, backend=backend, unsafe_disable=unsafe)
    elif backend is not None:
        rk.capture(model, backend=backend, unsafe_disable=unsafe)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(7):
            if i == 4:
                _write(model, case)
            x = torch.randn(5, 6, generator=g).to(device)
            y = torch.randn(5, 3, generator=g).to(device)
            if step is not None:
                step(x, y)
                continue
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return list(model.state_dict().values())


@pytest.mark.parametrize("entry", ["capture", "step"])
@pytest.mark.parametrize("case", ["parameter", "parameter_first", "buffer"])
def test_a_tensor_attribute_changed_records_anew(
    backend: str, device: str, case: str, entry: str
) -> None:
    if entry == "capture" and case != "buffer":
        pytest.skip("loss_fn's L2 term runs outside a captured forward: eager reads it")
    eager = _train(case, entry, None, device)
    assert same(eager, _train(case, entry, backend, device))
    assert not same(eager, _train(case, entry, backend, device, ("module_state",)))
