"""Hooks on parameters: post-accumulate and tensor hooks (their call order is part of the
end state), per-parameter optimizers stepping inside backward. A recording learns eager's order
and a replay keeps it (``guards/grad_hooks.py``, protection ``hook_order``); hooks added after a
recording record anew (``param_identity``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, loop, mlp, trainable
from .writing import HazardClass

HAZARD = "hook_order"
HC = HazardClass(HAZARD)


def _hooked(kind: str, register_at: int = 0) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        order: list[int] = []
        params = trainable(model)

        def register() -> None:
            for i, p in enumerate(params):
                if kind == "post_accumulate":
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
                else:

                    def clip(g: torch.Tensor, i: int = i) -> torch.Tensor:
                        order.append(i)
                        return g.clamp(-0.05, 0.05)

                    p.register_hook(clip)

        kept = loop(
            model, arm, steps=4, before=lambda m, s: register() if s == register_at else None
        )
        kept["hook_order"] = torch.tensor(order, dtype=torch.int64)
        return kept

    return train


def _optimizer_in_backward(model: nn.Module, arm: Arm) -> Extras:
    order: list[int] = []
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in trainable(model)}

    def hook(p: torch.Tensor, i: int) -> None:
        order.append(i)
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for i, p in enumerate(trainable(model)):
        p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))
    kept: Extras = {}
    for step in range(3):
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        kept[f"loss{step}"] = loss.detach()
    kept["hook_order"] = torch.tensor(order, dtype=torch.int64)
    return kept


PATTERNS: list[Pattern] = [
    HC.pattern(
        "post_accumulate_hook_order",
        "register_post_accumulate_grad_hook on every parameter",
        mlp(bn=True),
        _hooked("post_accumulate"),
        guard="hook_order",
    ),  # hooks before the first record: the recording learns eager's order
    HC.pattern(
        "post_accumulate_hook_midway",
        "post-accumulate hooks registered after recording",
        mlp(bn=True),
        _hooked("post_accumulate", register_at=2),
        guard="param_identity",
    ),  # the hook watcher
    HC.pattern(
        "tensor_hook_clip",
        "p.register_hook clipping each gradient, order recorded",
        mlp(bn=True),
        _hooked("tensor"),
        guard="hook_order",
    ),
    HC.pattern(
        "optimizer_in_backward",
        "per-parameter optimizers stepping in post-accumulate hooks",
        mlp(bn=True),
        _optimizer_in_backward,
        guard="hook_order",
    ),
]
