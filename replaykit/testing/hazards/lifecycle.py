"""Lifecycle and concurrency: weights changed between forward and backward, a step in
another thread.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, mlp, sgd
from .writing import HazardClass, stepped

HAZARD = "lifecycle"
HC = HazardClass(HAZARD)


def _inplace_weights(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        with torch.no_grad():
            model.fc2.weight.mul_(0.5)  # eager: "modified by an inplace operation" at backward
        loss.backward()
        opt.step()
    return {}


def _threaded(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    kept: Extras = {}

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()

    for i in range(4):
        if i == 2:
            errors: list[BaseException] = []
            worker = threading.Thread(target=_catching, args=(errors, step, i))
            worker.start()
            worker.join()
            if errors:
                raise errors[0]
        else:
            step(i)
    return kept


def _catching(errors: list[BaseException], fn: Callable[[int], None], i: int) -> None:
    try:
        fn(i)
    except BaseException as exc:
        errors.append(exc)


def _resume_optimizer(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """At step 3 the optimizer loads its own state dict (a resumed checkpoint: same values, new tensors)."""
    if step == 3:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))


PATTERNS: list[Pattern] = [
    HC.pattern(
        "inplace_weights_before_backward",
        "weights scaled in place between forward and backward",
        mlp(),
        _inplace_weights,
        guard="inplace_weights",
    ),
    HC.pattern(
        "step_in_another_thread",
        "one training step runs in a second thread",
        mlp(),
        _threaded,
    ),
    HC.pattern(
        "step_optimizer_state_loaded",
        "optimizer.load_state_dict after the step recorded",
        mlp(),
        stepped(steps=6, before=_resume_optimizer),
        guard="state_identity",
        api="step",
    ),
]
