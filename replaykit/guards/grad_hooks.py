"""Gradient hooks on parameters: run in eager's order after a replayed backward.

Eager's backward reaches the parameters one at a time: each parameter's AccumulateGrad node runs
(its tensor hooks, then its post-accumulate hooks: a per-parameter optimizer stepping inside
backward, a clip, a log) as soon as its gradient is ready. A replayed backward is one autograd
node that hands out every gradient at once; the engine would then run the AccumulateGrad nodes
in an order of its own, and that order is an end state (a log of it, a hook that reads another
parameter's ``.grad``, which in eager is not there yet: one hook on the first layer that clips
every gradient "at the end of backward" sees all of them in eager, only some after a replay).

So a recording learns eager's order (:func:`learn`: the probe's backward accumulates into
stand-ins that log it), and a replay passes its parameters through a chain of identity nodes
(:func:`chained`), built in reverse of that order. The replayed node's gradients make only the
chain's last link ready; each link hands its parameter's gradient to that AccumulateGrad, which
the engine runs before anything else (its priority is the highest), and only then readies the
next link. Gradients pass unchanged. The chain costs one small autograd node per parameter, and
is built only where a parameter carries a hook.

Learnt from one backward of the whole module, the order is eager's where the module's gradients
arrive together: a module with one differentiable output. With several, eager may run part of
the module's backward before the other outputs' gradients arrive, so hooks there stay refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["chained", "hooked", "learn"]


def hooked(params: Iterable[torch.Tensor]) -> frozenset[int]:
    """The ids of the parameters that carry gradient hooks (tensor or post-accumulate)."""
    return frozenset(id(p) for p in params if p._backward_hooks or p._post_accumulate_grad_hooks)


def learn(roots: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> list[int]:
    """The order in which eager's backward from ``roots`` accumulates into ``leaves`` (their
    indices; unreached ones left out). Accumulates into the leaves' ``.grad``: stand-ins only."""
    order: list[int] = []
    handles = [
        leaf.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
        for i, leaf in enumerate(leaves)
    ]
    try:
        torch.autograd.backward(
            list(roots), [torch.zeros_like(r) for r in roots], inputs=list(leaves)
        )
    finally:
        for handle in handles:
            handle.remove()
    return order


class _Link(torch.autograd.Function):
    """One parameter through the chain: its value unchanged, the token the next link waits on."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return param.view_as(param), token.view_as(token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None, _: Any) -> tuple[Any, ...]:
        return grad, None


def chained(params: Sequence[torch.Tensor], order: Sequence[int]) -> list[torch.Tensor]:
    """``params`` with those in ``order`` passed through the chain: their gradients reach
    AccumulateGrad one at a time, in ``order``."""
    out = list(params)
    if not order:
        return out
    token = torch.empty(0, device=params[order[0]].device)
    for i in reversed(order):
        out[i], token = _Link.apply(params[i], token)
    return out
