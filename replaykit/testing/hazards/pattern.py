"""What a hazard pattern is, and the pieces patterns are written with.

A :class:`Pattern` builds a tiny model on a device and trains it a few steps as a user
would write it; the runner (:mod:`.runner`) runs it twice from the same seed, eagerly
and replayed, and compares the end states bit for bit. A pattern's ``train`` gets the
model and an :class:`Arm`; it returns the extra tensors it keeps (losses, outputs, input
gradients, hook call order), which join the parameters, gradients and buffers.

Two entry points (``Pattern.api``): a ``"capture"`` pattern trains the model as plain
PyTorch, and the runner captures it (``rk.capture``) in the replay arm; a ``"step"``
pattern builds its training step with :meth:`Arm.train_step`, which is ``rk.TrainStep``
replaying in the replay arm and its eager twin (``replay=False``) in the eager arm; a
``"whole_step"`` pattern builds it through ``replaykit.lightning.whole_step`` inside a Lightning
``Trainer.fit`` (:mod:`.lightning_whole_step`).
:class:`MLP` and the loops below are what most patterns share, so every hazard module
writes only what is particular to it.

Imports only torch and the public core API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import replaykit as rk

Extras = dict[str, "torch.Tensor | None"]


APIS = ("capture", "step", "whole_step")


@dataclass
class Arm:
    """What a pattern's ``train`` knows about the run it is in.

    ``recorder``: the ``rk.capture`` recorder of a capture pattern's replay arm, or the
    ``rk.TrainStep`` a step pattern built (the runner reads its journal). ``backend`` and
    ``unsafe_disable``: what :meth:`train_step` builds with.
    """

    device: str
    name: str  # "eager", "replay" or "unsafe"
    recorder: object | None = None
    backend: str = "emulated"
    unsafe_disable: tuple[str, ...] = ()
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)

    @property
    def replay(self) -> bool:
        """Whether this arm replays (the eager arm is the reference)."""
        return self.name != "eager"

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device)

    def train_step(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        **kwargs: Any,
    ) -> rk.TrainStep:
        """A step pattern's ``rk.TrainStep``: replaying in the replay arm (with the arm's
        ``unsafe_disable``), its eager twin in the eager arm; same backend, same ``kwargs``.
        The optimizer's state joins the end state."""
        step = rk.TrainStep(
            model,
            loss_fn,
            optimizer,
            replay=self.replay,
            backend=self.backend,
            unsafe_disable=self.unsafe_disable if self.replay else (),
            **kwargs,
        )
        self.optimizers.append(optimizer)
        if self.replay:
            self.recorder = step
        return step


@dataclass(frozen=True)
class Pattern:
    """One realistic training pattern.

    ``guard``: the ``unsafe_disable`` name of the protection that keeps it exact (its
    unsafe arm must diverge). ``cuda_only`` / ``cpu_only``: why the unsafe arm diverges
    only on that backend (the other's unsafe test is skipped with this reason);
    ``unsafe_never``: why no backend measured here shows it (the guard's negative
    control is another pattern). ``kernel_dependent``: the unsafe arm's divergence comes
    from a kernel's sensitivity to layout or aliasing, which differs between machines
    (it diverged on the development CPU, not on the H200 host's CPU): where it does not
    show, the notebook says so instead of failing. ``target``: which module to
    capture (default: the whole model; a capture pattern's only).

    ``api``: ``"capture"`` (the runner captures the model) or ``"step"`` (``train`` builds
    its step with :meth:`Arm.train_step`; ``guard`` then names a ``TrainStep`` protection) or
    ``"whole_step"`` (the same step built by ``replaykit.lightning.whole_step`` in a ``Trainer.fit``).
    ``may_hang``: the pattern has hung in native code somewhere (a CUDA capture, a lock
    in the autograd engine), where no in-process deadline can stop it: the runner runs
    it in a child process it can kill. ``may_fault``: without its guard a CUDA replay reads
    memory freed after the capture (a reassigned tensor attribute); where the allocator gave
    that memory back to the driver the read faults, and an illegal address poisons the whole
    process's CUDA context (seen on the H200): its unsafe CUDA arm runs in a child process too.
    ``timeout_s``: its deadline per run, if not the runner's default.
    """

    name: str
    hazard: str
    what: str
    make: Callable[[str], nn.Module]
    train: Callable[[nn.Module, Arm], Extras]
    guard: str | None = None  # "a+b": both switched off in the unsafe arm
    cuda_only: str | None = None
    cpu_only: str | None = None
    unsafe_never: str | None = None
    kernel_dependent: bool = (
        False  # the unsafe arm diverges only where kernels are layout/alias sensitive
    )
    target: Callable[[nn.Module], nn.Module] | None = None
    tags: tuple[str, ...] = field(default=())
    api: str = "capture"
    may_hang: bool = False
    may_fault: bool = False
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"pattern {self.name!r}: api {self.api!r}, choose from {APIS}")
        if self.api != "capture" and self.target is not None:
            raise ValueError(
                f"pattern {self.name!r}: a step pattern steps its whole model (no target)"
            )


# --------------------------------------------------------------------------- the shared net
class MLP(nn.Module):
    """Linear -> (BatchNorm) -> ReLU -> Dropout -> Linear, with knobs users flip."""

    def __init__(
        self, d_in: int = 6, d_h: int = 8, d_out: int = 3, bn: bool = False, p: float = 0.0
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.bn = nn.BatchNorm1d(d_h) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(d_h, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def mlp(**kw) -> Callable[[str], nn.Module]:
    """A pattern's ``make``: an :class:`MLP` with these knobs on the arm's device."""
    return lambda device: MLP(**kw).to(device)


# --------------------------------------------------------------------------- the shared loops
def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    """SGD with momentum: its state makes a wrong gradient show in every later step."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def trainable(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that require grad, in registration order."""
    return [p for p in model.parameters() if p.requires_grad]


def loop(
    model: nn.Module,
    arm: Arm,
    steps: int = 3,
    shape: tuple[int, ...] = (4, 6),
    call: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] | None = None,
    before: Callable[[nn.Module, int], None] | None = None,
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.pow(2).mean(),
) -> Extras:
    """The plain loop: zero_grad, forward, loss, backward, step; keeps every loss.

    ``call(model, x, step)`` replaces ``model(x)``; ``before(model, step)`` runs first in
    each step (a schedule, a mode switch, a hook registered midway).
    """
    opt = sgd(model)
    kept: Extras = {}
    for step in range(steps):
        if before is not None:
            before(model, step)
        opt.zero_grad(set_to_none=True)
        x = arm.randn(*shape)
        out = call(model, x, step) if call is not None else model(x)
        value = loss(out)
        value.backward()
        opt.step()
        kept[f"loss{step}"] = value.detach()
    return kept


def loss_steps(
    model: nn.Module,
    arm: Arm,
    step: Callable[[nn.Module, Arm], torch.Tensor],
    n: int = 4,
    opt: torch.optim.Optimizer | None = None,
) -> Extras:
    """``n`` optimizer steps of ``step(model, arm) -> loss``, keeping each loss (a loop whose loss reads more than the output)."""
    opt = opt or sgd(model)
    kept: Extras = {}
    for i in range(n):
        opt.zero_grad(set_to_none=True)
        loss = step(model, arm)
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()
    return kept


def set_at(step_at: int, fn: Callable[[nn.Module], None]) -> Callable[[nn.Module, int], None]:
    """A ``loop`` ``before`` that calls ``fn(model)`` once, at step ``step_at``."""

    def before(model: nn.Module, step: int) -> None:
        if step == step_at:
            fn(model)

    return before


def setter(
    attr: str, value: object, step: int = 2, sub: str | None = None
) -> Callable[[nn.Module, int], None]:
    """A ``loop`` ``before`` that sets ``attr`` (of submodule ``sub``) to ``value`` at ``step``."""

    def fn(model: nn.Module) -> None:
        setattr(model.get_submodule(sub) if sub else model, attr, value)

    return set_at(step, fn)


def step_loop(
    model: nn.Module,
    arm: Arm,
    loss_fn: Callable[..., torch.Tensor] = lambda m, x: m(x).pow(2).mean(),
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = sgd,
    steps: int = 5,
    shape: tuple[int, ...] = (4, 6),
    before: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None,
    **step_kwargs: Any,
) -> Extras:
    """A step pattern's loop: ``loss = step(x)`` per batch through :meth:`Arm.train_step`;
    keeps every loss. ``before(model, optimizer, step)`` runs before each call (a schedule,
    a hand-made change); ``step_kwargs`` go to ``rk.TrainStep`` (``accumulate``, ``warmup``...)."""
    opt = optimizer(model)
    step = arm.train_step(model, loss_fn, opt, **step_kwargs)
    kept: Extras = {}
    for i in range(steps):
        if before is not None:
            before(model, opt, i)
        kept[f"loss{i}"] = step(arm.randn(*shape)).detach()
    return kept
