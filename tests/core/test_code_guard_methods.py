"""A module global read through code the forward or ``loss_fn`` reaches by attribute keys the
recording as one they name directly: a method of the model's own class, a submodule's method, a
held object's method or ``@property``, a ``@staticmethod`` / ``@classmethod``, and a helper whose
decorator wraps it (``@torch.no_grad()``: the wrapper is torch's code, ``__wrapped__`` the user's).
Each replayed the first epoch's value silently (hostile review round 4, cause 1). Every case runs
under ``rk.capture`` and ``rk.TrainStep`` against a plain eager loop, bit for bit, replays once per
epoch value (a value set back replays its recording), and diverges with the guard switched off.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

_EPOCH = 0
EPOCHS = (0, 0, 0, 1, 1, 1, 2, 2, 0)  # the loop's schedule; the last call goes back to epoch 0


class Schedule:
    """A schedule object the model or the loss holds; its values come from the global epoch."""

    def factor(self) -> float:
        return 1.0 + 0.5 * _EPOCH

    @property
    def value(self) -> float:
        return 1.0 + 0.5 * _EPOCH


@torch.no_grad()
def decorated_factor() -> float:
    return 1.0 + 0.5 * _EPOCH


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)


class Plain(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class WithAux(Plain):
    """A model whose method ``loss_fn`` calls through its argument (``model.aux()``)."""

    def aux(self) -> float:
        return 1.0 + 0.5 * _EPOCH


class OwnMethod(Base):
    def factor(self) -> float:
        return 1.0 + 0.5 * _EPOCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.factor()


class StaticMethod(Base):
    @staticmethod
    def factor() -> float:
        return 1.0 + 0.5 * _EPOCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.factor()


class ClassMethod(Base):
    @classmethod
    def factor(cls) -> float:
        return 1.0 + 0.5 * _EPOCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.factor()


class DecoratedMethod(Base):
    @torch.no_grad()
    def factor(self) -> float:
        return 1.0 + 0.5 * _EPOCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.factor()


class HeldMethod(Base):
    def __init__(self) -> None:
        super().__init__()
        self.sched = Schedule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.sched.factor()


class HeldProperty(HeldMethod):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.sched.value


class DecoratedHelper(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * decorated_factor()


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def rate(self) -> float:
        return 1.0 + 0.5 * _EPOCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class SubmoduleMethod(Base):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.gate(x) * self.gate.rate())


FORWARDS = {
    "own_method": OwnMethod,
    "staticmethod": StaticMethod,
    "classmethod": ClassMethod,
    "decorated_method": DecoratedMethod,
    "held_method": HeldMethod,
    "held_property": HeldProperty,
    "decorated_helper": DecoratedHelper,
    "submodule_method": SubmoduleMethod,
}


def _ce(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(m(x), y)


def _loss(how: str):
    """A ``loss_fn`` that weighs its loss by the epoch through what its closure holds."""
    sched = Schedule()
    if how == "loss_held_method":
        return lambda m, x, y: _ce(m, x, y) * sched.factor()
    if how == "loss_held_property":
        return lambda m, x, y: _ce(m, x, y) * sched.value
    if how == "loss_model_method":
        return lambda m, x, y: _ce(m, x, y) * m.aux()
    return lambda m, x, y: _ce(m, x, y) * decorated_factor()


LOSSES = ("loss_held_method", "loss_held_property", "loss_decorated_helper", "loss_model_method")


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in EPOCHS
    ]


def _run(how: str, entry: str, replay: bool = True, disable: tuple[str, ...] = ()):
    """Train with the epoch advanced by the loop, under ``entry`` or (``replay`` False) its plain
    eager loop: forward, backward, step (TrainStep's sets the gradients to None after its step, as
    its own eager run does). Returns the losses, the parameters, their gradients, the counts."""
    global _EPOCH
    torch.manual_seed(0)
    net = (
        (WithAux() if how == "loss_model_method" else Plain()) if how in LOSSES else FORWARDS[how]()
    )
    loss_fn = _loss(how) if how in LOSSES else _ce
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    step = rec = None
    if replay and entry == "step":
        step = rk.TrainStep(net, loss_fn, opt, backend="emulated", unsafe_disable=disable)
    elif replay:
        rec = rk.capture(net, backend="emulated", unsafe_disable=disable)
    losses = []
    try:
        for epoch, (x, y) in zip(EPOCHS, _data(), strict=True):
            _EPOCH = epoch
            if step is not None:
                losses.append(step(x, y))
                continue
            loss = loss_fn(net, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if entry == "step":
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    finally:
        _EPOCH = 0
        counts = (step or rec).counts if (step or rec) is not None else {}
        if rec is not None:
            rec.release()
    grads = [p.grad for p in net.parameters()]
    return losses, [p.detach().clone() for p in net.parameters()], grads, counts


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _equal(run: tuple, eager: tuple) -> bool:
    return all(_same(got, want) for got, want in zip(run[:3], eager[:3], strict=True))


CASES = [(how, entry) for how in FORWARDS for entry in ("capture", "step")]
CASES += [(how, "step") for how in LOSSES]


@pytest.mark.filterwarnings("ignore::replaykit.ReplayWarning")
@pytest.mark.parametrize(("how", "entry"), CASES)
def test_a_global_read_through_reached_code_keys_the_recording(how: str, entry: str) -> None:
    eager = _run(how, entry, replay=False)
    replayed = _run(how, entry)
    assert _equal(replayed, eager)
    counts = replayed[3]
    # one recording per epoch value; the epoch set back to 0 replays its recording
    assert counts["record"] == 3 and counts["replay"] >= 5, counts


@pytest.mark.filterwarnings("ignore::replaykit.ReplayWarning")
@pytest.mark.parametrize(("how", "entry"), CASES)
def test_without_the_code_guard_the_first_epoch_replays(how: str, entry: str) -> None:
    # the model's code (its forward's, or a method loss_fn calls on it) is forward_inputs' to key
    guard = "loss_inputs" if how in LOSSES and how != "loss_model_method" else "forward_inputs"
    eager = _run(how, entry, replay=False)
    unsafe = _run(how, entry, disable=negative_control(guard))
    assert not _equal(unsafe, eager)
