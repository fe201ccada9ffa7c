"""A whole step whose forward assigns tensors to attributes replays: an MoE layer's
``self.aux_loss`` (read by ``loss_fn``, logged by the loop), DINO's re-bound centre (read and
replaced every call), a tensor set in a dict the model holds. The tensors are outputs of the
recording, bound (as copies) after each replay; a state is read from a slot fed before each
replay (protection ``attribute_outputs``, ``memory/attribute_outputs.py``). Every call is compared
with the eager twin: loss, parameters, each ``.grad`` and its None pattern, and the attributes."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control
from replaykit.testing.hazards.recording_call import CentredHead
from replaykit.testing.hazards.side_effects import Cache, MoE

from ._same import same


def _moe_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean() + 0.1 * m.aux_loss


def _mse(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def _feats_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return out.pow(2).mean() + 0.01 * m.feats["h"].pow(2).mean()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable, Callable[[nn.Module], torch.Tensor]]] = {
    "moe_aux_loss": (MoE, _moe_loss, lambda m: m.aux_loss),
    "dino_centre": (CentredHead, _mse, lambda m: m.center),
    "held_dict_entry": (Cache, _feats_loss, lambda m: m.feats["h"]),
}


def _run(
    case: str, replay: bool, backend: str = "emulated", unsafe: tuple[str, ...] = (), steps: int = 6
) -> tuple:
    """Per call: the loss, the attribute as the loop logs it (a reference, not a copy), the
    parameters and gradients; and the step (None: the eager twin)."""
    make, loss_fn, attr = CASES[case]
    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(model, loss_fn, opt, replay=replay, backend=backend, unsafe_disable=unsafe)
    torch.manual_seed(1)
    batches = [torch.randn(4, 6).to(device) for _ in range(steps)]
    seen, logged = [], []
    for x in batches:
        loss = step(x)
        logged.append(attr(model).detach())  # kept as logged: not a copy
        seen.append([loss, *(p.detach().clone() for p in model.parameters())])
        seen[-1] += [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return seen, logged, step if replay else None


@pytest.mark.parametrize("case", sorted(CASES))
def test_attribute_outputs_replay_bitwise(case: str, backend: str) -> None:
    eager, eager_logged, _ = _run(case, False, backend)
    seen, logged, step = _run(case, True, backend)
    assert same(seen, eager)
    assert same(logged, eager_logged)
    assert step.counts["replay"] >= 2, step.summary()  # it replays, not merely routes
    assert step.counts["retire"] == 0, step.summary()


def test_without_binding_the_logged_attributes_differ(backend: str) -> None:
    """Switched off, each replay leaves the attribute bound to the recording's static tensor,
    which the next replay overwrites: the losses the loop logged read the last call's values."""
    _, eager_logged, _ = _run("moe_aux_loss", False, backend)
    _, logged, step = _run("moe_aux_loss", True, backend, negative_control("attribute_outputs"))
    assert step.counts["replay"] >= 2, step.summary()
    assert not same(logged, eager_logged)


def test_a_state_of_a_new_shape_records_anew() -> None:
    """The centre's slot has its shape: a centre re-made at another width keys a new recording
    instead of replaying the old slot."""
    torch.manual_seed(0)
    model, twin = CentredHead(), CentredHead()
    twin.load_state_dict(model.state_dict())
    steps = [
        rk.TrainStep(m, _mse, torch.optim.SGD(m.parameters(), lr=0.1), replay=r, backend="emulated")
        for m, r in ((model, True), (twin, False))
    ]
    torch.manual_seed(1)
    batches = [torch.randn(4, 6) for _ in range(8)]
    for i, x in enumerate(batches):
        if i == 4:  # the head re-made, its centre a (1, 3) row: broadcasts the same
            for m in (model, twin):
                m.center = m.center.reshape(1, 3).clone()
        losses = [s(x) for s in steps]
        assert same(losses[0], losses[1]), i
        assert same(model.center, twin.center), i
    assert steps[0].counts["record"] >= 2, steps[0].summary()


class PreviousBatch(nn.Module):
    """Online smoothing: adds the previous batch's features where the batch size matches, then
    keeps this batch's (a state whose shape follows the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.head = nn.Linear(6, 6), nn.Linear(6, 3)
        self.prev: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        if self.prev is not None and self.prev.shape == h.shape:
            h = h + 0.5 * self.prev
        self.prev = h.detach()
        return self.head(h)


SIZES = (4, 4, 6, 4, 6, 6, 4, 6, 6, 4)


def _previous_batch(replay: bool, capture: bool) -> tuple[list, rk.Recorder | rk.TrainStep | None]:
    torch.manual_seed(0)
    model = PreviousBatch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    entry: rk.Recorder | rk.TrainStep | None = None
    if capture:
        entry = rk.capture(model, backend="emulated") if replay else None
    else:
        entry = rk.TrainStep(model, _mse, opt, replay=replay, backend="emulated")
    torch.manual_seed(1)
    seen = []
    for b in SIZES:
        x = torch.randn(b, 6)
        if capture:
            opt.zero_grad()
            _mse(model, x).backward()
            opt.step()
        else:
            assert entry is not None
            entry(x)
        seen.append([model.prev.clone(), *(p.detach().clone() for p in model.parameters())])
    return seen, entry if replay else None


@pytest.mark.parametrize("capture", [False, True], ids=["step", "capture"])
def test_a_state_whose_shape_follows_the_batch_replays_per_shape(capture: bool) -> None:
    """A replay that binds a state of another shape than its slot's keys the next call anew: the
    next call records or replays the recording made for that shape (it fed the old slot and
    raised before)."""
    eager, _ = _previous_batch(False, capture)
    seen, entry = _previous_batch(True, capture)
    assert same(seen, eager)
    assert entry is not None and entry.counts["replay"] >= 2, entry.summary()


class RetainsGrad(nn.Module):
    """Grad-CAM style: keeps an activation whose gradient it retains; the loop reads ``.h.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        h.retain_grad()
        self.h = h
        return self.l2(h)


def _retained(replay: bool, capture: bool) -> list:
    torch.manual_seed(0)
    model = RetainsGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(model, _mse, opt, replay=replay, backend="emulated")
    if capture and replay:
        rk.capture(model, backend="emulated")
    torch.manual_seed(1)
    seen = []
    for _ in range(5):
        x = torch.randn(4, 6)
        if capture:
            opt.zero_grad()
            _mse(model, x).backward()
            opt.step()
        else:
            step(x)
        seen.append(model.h.grad)
    return seen


@pytest.mark.parametrize("capture", [False, True], ids=["step", "capture"])
def test_an_attribute_that_retains_its_grad_stays_eager(capture: bool) -> None:
    """A replay's tensor would carry no ``.grad`` (eager's activation has this batch's): such a
    write is no recorded output, and the calls run eagerly, exact."""
    assert same(_retained(True, capture), _retained(False, capture))


def _teacher_centre(replay: bool, unsafe: tuple[str, ...] = ()) -> tuple[list, rk.TrainStep]:
    """DINO's loss: ``loss_fn`` holds a frozen teacher whose centre it re-binds every call."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    teacher = copy.deepcopy(student).requires_grad_(False)
    teacher.center = torch.zeros(3)

    def loss_fn(s: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = teacher(x)
            target = ((out - teacher.center) / 0.5).softmax(-1)
            teacher.center = 0.9 * teacher.center + 0.1 * out.mean(0)
        return -(target * torch.log_softmax(s(x), -1)).sum(-1).mean()

    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    step = rk.TrainStep(
        student, loss_fn, opt, backend="emulated", replay=replay, unsafe_disable=unsafe
    )
    torch.manual_seed(1)
    seen = []
    for _ in range(6):
        step(torch.randn(4, 6))
        seen.append([teacher.center.clone(), *(p.detach().clone() for p in student.parameters())])
    return seen, step


def test_a_teacher_loss_fn_holds_re_binding_its_centre_stays_eager() -> None:
    """A module outside the model is no recording's: its re-bound centre would stay the
    recording call's. The step retires, naming it, exact; without ``side_effects`` (and
    ``loss_inputs``, whose key reads the teacher's tensor attributes too: a new centre every call
    is a new recording every call), it diverges."""
    eager, _ = _teacher_centre(False)
    seen, step = _teacher_centre(True)
    assert same(seen, eager)
    assert "re-binds Sequential.center" in step.summary(), step.summary()
    unsafe, step = _teacher_centre(True, negative_control("side_effects", "loss_inputs"))
    assert step.counts["replay"] >= 1 and not same(unsafe, eager)


def _reset_by_the_loop(replay: bool) -> tuple[list, rk.TrainStep | None]:
    """The loop logs the aux loss and sets it to None after each step (so a stale one is never
    read): the model then holds no tensor attribute when a call starts."""
    torch.manual_seed(0)
    model = MoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(model, _moe_loss, opt, backend="emulated", replay=replay)
    torch.manual_seed(1)
    logged = []
    for _ in range(6):
        logged.append([step(torch.randn(4, 6)), model.aux_loss.detach()])
        model.aux_loss = None
    return logged, step if replay else None


def test_an_attribute_the_loop_resets_to_none_replays() -> None:
    eager, _ = _reset_by_the_loop(False)
    seen, step = _reset_by_the_loop(True)
    assert same(seen, eager)
    assert step is not None and step.counts["replay"] >= 3, step.summary()
