"""Gradients the caller keeps: a gradient-norm history of views, an optimizer holding ``.grad``'s data.

Eager's ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place and the next backward
accumulates into it, and between a whole step's micro-batches ``.grad`` is one running sum: a
reference, view or ``.data`` of ``.grad`` kept by the caller *is* the gradient of every later
step. A replay hands out its static gradient buffers, which the next replay overwrites, so copy-out
moves a held gradient to memory of its own first, with every holder of its storage at once
(``replaykit/memory/copy_out.py``). On a torch without the storage swap such a gradient stays put:
a captured network gives it to the caller and records anew (``grads_given_away``; the later calls
replay), the whole step runs the call eagerly (``live_alias``). Without copy-out the kept tensors
hold a recorded buffer the replays overwrite, or accumulate twice into it.
"""

from __future__ import annotations

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, mlp, sgd, trainable
from .writing import HazardClass

HAZARD = "kept_grads"
HC = HazardClass(HAZARD)


def _norm_history(model: nn.Module, arm: Arm, steps: int = 5) -> Extras:
    """``zero_grad(set_to_none=False)`` loop keeping each step's first-layer gradient as a flat
    view, read at the end (eager's views all see the last gradient: one tensor throughout)."""
    opt = sgd(model)
    kept: Extras = {}
    for i in range(steps):
        opt.zero_grad(set_to_none=False)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()
        kept[f"flat{i}"] = model.fc1.weight.grad.view(-1)
    return kept


class HeldGrads:
    """A hand-written optimizer that gathers the gradients' ``.data`` once and reads them at every
    step (as flat-buffer optimizers keep views of ``.grad``): SGD with a gradient-sign clip."""

    def __init__(self, params: list[torch.Tensor], lr: float = 0.05) -> None:
        self.params, self.lr = params, lr
        self.grads: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self) -> None:
        if self.grads is None:
            self.grads = [p.grad.data for p in self.params]
        for p, g in zip(self.params, self.grads, strict=True):
            p.sub_(self.lr * g.clamp(-0.5, 0.5))

    def zero_grad(self) -> None:
        for g in self.grads or [p.grad for p in self.params if p.grad is not None]:
            g.zero_()


def _held_by_optimizer(model: nn.Module, arm: Arm, steps: int = 5) -> Extras:
    opt = HeldGrads(trainable(model))
    kept: Extras = {}
    for i in range(steps):
        opt.zero_grad()
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()
    return kept


def _micro_batch_history(model: nn.Module, arm: Arm, steps: int = 6) -> Extras:
    """A whole step over two micro-batches; after each call the running gradient kept as a flat
    view (eager's: the same tensor through a step's micro-batches, left with its sum after)."""
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), sgd(model), accumulate=2)
    kept: Extras = {}
    for i in range(steps):
        kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
        grad = model.fc1.weight.grad
        if grad is not None:
            kept[f"flat{i}"] = grad.view(-1)
    return kept


PATTERNS: list[Pattern] = [
    HC.pattern(
        "grad_norm_history_of_views",
        "zero_grad(set_to_none=False); each step keeps p.grad.view(-1) for a gradient-norm history",
        mlp(),
        _norm_history,
        guard="copy_out",
    ),
    HC.pattern(
        "optimizer_holds_grad_data",
        "a hand-written optimizer gathers [p.grad.data] once and steps from it; zeroes in place",
        mlp(),
        _held_by_optimizer,
        guard="copy_out",
    ),
    HC.pattern(
        "step_micro_batch_grad_views",
        "the running gradient between micro-batches kept as a view after each call",
        mlp(),
        _micro_batch_history,
        guard="copy_out",
        api="step",
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
