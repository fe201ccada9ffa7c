"""A teacher outside the model, written in ways no ``setattr`` reports (hostile rounds 11-12).

Its key is read on every call; a cheap first look (is anything re-bound, did anything that can
change in place change) decides whether to read it in full. Each write below, made midway, must
record anew and train exactly as eager; an untouched teacher must keep replaying.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk

from ._same import same


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.scale = 1.0
        self.cfg = ([1.0],)  # a list inside a tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale * self.cfg[0][0]


class HalfBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


def _halve(m: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 0.5


def _new_child(teacher: nn.Module) -> None:
    torch.manual_seed(5)
    teacher.block._modules["lin"] = nn.Linear(6, 3).to(teacher.block.lin.weight.device)


WRITES: dict[str, Callable[[nn.Module], object] | None] = {
    "nothing": None,
    "float_past_setattr": lambda t: vars(t.block).__setitem__("scale", 0.5),
    "list_in_tuple": lambda t: t.block.cfg[0].__setitem__(0, 0.5),
    "hook_added": lambda t: t.block.register_forward_hook(_halve),
    "child_replaced_in_place": _new_child,
    "class_swapped": lambda t: setattr(t.block, "__class__", HalfBlock),
}


def _train(write: str, backend: str | None, device: str) -> tuple[list, dict]:
    torch.manual_seed(0)
    teacher = nn.Sequential()
    teacher.block = Block()
    teacher = teacher.to(device).requires_grad_(False)
    held = {"teacher": teacher}
    model = nn.Linear(6, 3).to(device)

    def distil(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) - held["teacher"](x)).pow(2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(model, distil, opt, backend=backend) if backend else None
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(7):
            if i == 4 and WRITES[write] is not None:
                WRITES[write](teacher)
            x = torch.randn(4, 6, generator=g).to(device)
            if step is not None:
                step(x)
                continue
            distil(model, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return list(model.state_dict().values()), dict(step.counts) if step else {}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_to_an_outside_teacher_records_anew(backend: str, device: str, write: str) -> None:
    eager, _ = _train(write, None, device)
    replayed, counts = _train(write, backend, device)
    assert same(eager, replayed)
    assert counts["replay"] >= 2  # before the write, and after its new recording
    assert counts["record"] == (1 if write == "nothing" else 2)
