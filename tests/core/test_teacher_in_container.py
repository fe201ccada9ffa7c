"""A frozen teacher ``loss_fn`` reaches through a container (hostile round 10).

The loop loads the teacher's weights as new tensors (``load_state_dict(assign=True)``): a
recording reads the old tensors' memory, so the step must record anew (it replayed the old
weights, silently). Updating the weights in place keeps the tensors: that replays.
"""

from __future__ import annotations

import copy
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


class KD(nn.Module):
    """A distillation criterion holding its teacher as a registered child."""

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = teacher

    def forward(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) - self.teacher(x)).pow(2).mean()


def _copy_student(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    kd.teacher = copy.deepcopy(student).requires_grad_(False)


def _rebind_data(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    for p in kd.teacher.parameters():
        p.data = p.data * 0.9  # new memory: a CUDA graph read the old


def _unfreeze(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    kd.teacher.requires_grad_(True)  # eager now gives the teacher gradients


def _temperature(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    kd.teacher.scale = torch.full((), 0.5, device=student.weight.device)


def _past_setattr(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    vars(kd.teacher)["gain"] = 0.5  # no write is reported (hostile round 12)


def _class_swapped(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    kd.teacher.__class__ = Doubled


def _hook_added(kd: KD, teacher: nn.Module, student: nn.Module) -> None:
    kd.teacher.register_forward_hook(lambda m, args, out: out * 2)


CHANGES = {
    "student_copied_in": _copy_student,
    "data_rebound": _rebind_data,
    "unfrozen": _unfreeze,
    "tensor_attribute_rebound": _temperature,
    "value_written_past_setattr": _past_setattr,
    "class_swapped": _class_swapped,
    "forward_hook_added": _hook_added,
}


class Scaled(nn.Linear):
    """A teacher whose output a plain tensor attribute and a float scale."""

    gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale * self.gain


class Doubled(Scaled):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_teacher_changed_midway(backend: str, device: str, change: str) -> None:
    """What a distillation loop does to its teacher at step 3 (hostile round 11): the replays read
    the teacher's new state, as eager does (they read the recording's, silently)."""

    def train(replay: bool) -> list:
        torch.manual_seed(0)
        student = nn.Linear(6, 3).to(device)
        teacher = Scaled(6, 3).to(device).requires_grad_(False)
        teacher.scale = torch.ones((), device=device)
        kd = KD(teacher)
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        step = rk.TrainStep(student, kd, opt, backend=backend) if replay else None
        g = torch.Generator().manual_seed(1)
        for i in range(6):
            if i == 3:
                CHANGES[change](kd, teacher, student)
            x = torch.randn(4, 6, generator=g).to(device)
            if step is not None:
                step(x)
            else:
                kd(student, x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        grads = [p.grad for p in kd.teacher.parameters()]
        return [*student.state_dict().values(), *kd.teacher.state_dict().values(), *grads]

    assert same(train(False), train(True))


def test_swap_tensors_on_a_replayed_model() -> None:
    """The module guard holds no weak reference to a parameter: ``torch.utils.swap_tensors`` (and
    ``half()`` under the swap-on-conversion flag) refused one."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    rk.capture(model, backend="emulated", warmup=1)
    model(torch.randn(5, 6)).sum().backward()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.half().float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model[0].weight.dtype == torch.float32
