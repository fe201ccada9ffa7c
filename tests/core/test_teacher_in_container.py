"""A frozen teacher ``loss_fn`` reaches through a container (hostile round 10).

The loop loads the teacher's weights as new tensors (``load_state_dict(assign=True)``): a
recording reads the old tensors' memory, so the step must record anew (it replayed the old
weights, silently). Updating the weights in place keeps the tensors: that replays.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk

from ._same import same

HOLDERS: dict[str, Callable[[nn.Module], tuple[object, Callable[[object], nn.Module]]]] = {
    "dict": lambda t: ({"teacher": t}, lambda h: h["teacher"]),
    "list": lambda t: ([t], lambda h: h[0]),
    "object": lambda t: (types.SimpleNamespace(teacher=t), lambda h: h.teacher),
}


def _net(device: str) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def _train(backend: str, device: str, holder: str, assign: bool, replay: bool) -> tuple:
    torch.manual_seed(0)
    teacher, model = _net(device).requires_grad_(False), _net(device)
    held, get = HOLDERS[holder](teacher)

    def distil(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) - get(held)(x)).pow(2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(model, distil, opt, backend=backend) if replay else None
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        if assign:
            new = {k: v * 0.9 for k, v in teacher.state_dict().items()}
            teacher.load_state_dict(new, assign=True)
        else:
            with torch.no_grad():
                for p in teacher.parameters():
                    p.mul_(0.9)
        x = torch.randn(4, 6, generator=g).to(device)
        if step is not None:
            step(x)
        else:
            opt.zero_grad(set_to_none=True)
            distil(model, x).backward()
            opt.step()
    return list(model.state_dict().values()), step.counts if step is not None else None


@pytest.mark.parametrize("holder", sorted(HOLDERS))
@pytest.mark.parametrize("assign", [True, False], ids=["loaded_as_new_tensors", "in_place"])
def test_teacher_in_a_container(backend: str, device: str, holder: str, assign: bool) -> None:
    eager, _ = _train(backend, device, holder, assign, replay=False)
    replayed, counts = _train(backend, device, holder, assign, replay=True)
    assert same(eager, replayed)
    if assign:  # new tensors every step: every call a new recording
        assert counts["replay"] == 0 and counts["record"] >= 2
    else:
        assert counts["replay"] >= 3
