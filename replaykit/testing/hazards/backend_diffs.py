"""Differences one backend shows and the other may not: a weight's gradient summed from several
uses (the order of the sum), Adagrad's step counter (on the CPU by default), an interrupt at the
recording call that the loop survives, dropout recomputed by non-reentrant checkpointing.

Each must end bitwise equal to eager on both backends; where only one backend showed the
difference, the pattern says which in its comment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, mlp, sgd, step_loop
from .side_effects import Checkpointed
from .writing import HazardClass, built, looped, stepped

HAZARD = "backend_diffs"
HC = HazardClass(HAZARD)


class TwiceBlock(nn.Module):
    """A block whose one linear layer is applied twice per call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Unrolled(nn.Module):
    """The block called twice per step (a weight-tied unrolled refinement), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = TwiceBlock()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


def _interrupted(where: str) -> Callable[[nn.Module, Arm], Extras]:
    """A Ctrl-C arriving during the second call (the recording call of the default warm-up),
    raised from ``loss_fn`` or from a forward hook; the loop catches it and trains on."""

    def train(model: nn.Module, arm: Arm) -> Extras:
        pending = [False]

        def interrupt() -> None:
            if pending[0]:
                pending[0] = False
                raise KeyboardInterrupt

        def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            out = m(x)
            if where == "loss":
                interrupt()
            return out.pow(2).mean()

        if where == "hook":
            model.fc2.register_forward_hook(lambda mod, args, out: interrupt())
        opt = sgd(model)
        step = arm.train_step(model, loss_fn, opt)
        kept: Extras = {}
        for i in range(6):
            pending[0] = i == 1
            try:
                kept[f"loss{i}"] = step(arm.randn(4, 6))
            except KeyboardInterrupt:
                opt.zero_grad(set_to_none=True)  # the user's recovery: drop the half-done step
                kept[f"interrupted{i}"] = torch.tensor(1.0)
        return kept

    return train


PATTERNS: list[Pattern] = [
    *HC.twins(
        "block_called_twice_weight_used_twice",
        "a captured block called twice per step, its weight used twice per call (gradient sum order)",
        built(Unrolled),
        looped(steps=4),
        stepped(steps=5),
        step_what="a block called twice per step, its weight used twice per call, whole step",
        step=dict(target=None, guard=None),
        target=lambda m: m.block,
        guard="reentry",
    ),
    HC.pattern(
        "step_adagrad_defaults",
        "torch.optim.Adagrad with its defaults (its step count on the CPU)",
        mlp(),
        lambda m, a: step_loop(
            m, a, optimizer=lambda m: torch.optim.Adagrad(m.parameters()), steps=5
        ),
        api="step",
    ),  # differed on the H200 only
    HC.pattern(
        "step_keyboard_interrupt_in_loss",
        "KeyboardInterrupt from loss_fn at the recording call, caught",
        mlp(),
        _interrupted("loss"),
        api="step",
    ),  # differed on the H200 only
    HC.pattern(
        "step_keyboard_interrupt_in_hook",
        "KeyboardInterrupt from a forward hook at the recording call, caught",
        mlp(),
        _interrupted("hook"),
        api="step",
    ),
    HC.pattern(
        "step_checkpointed_dropout",
        "checkpoint(use_reentrant=False) around a block with dropout, whole step",
        built(Checkpointed),
        stepped(steps=5),
        api="step",
    ),  # the emulated backend's bug (the H200 replays it): no guard; capture's is side_effects'
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
