"""The emulated backend: CUDA-graph buffer semantics on any device, so CI sees the hazards.

A replay runs the module's own forward (so every value is eager's, bit for bit), then
overwrites the recording's static outputs in place and keeps that run's autograd
graph as the recording's single set of saved activations. A replayed backward reads
whatever forward ran last and overwrites the static gradient buffers in place. So
the hazards of real graphs reproduce on a CPU: an alias of a static buffer changes
under the caller, and a backward pending across a second forward reads the second
forward's activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_flatten

from .base import (
    Backend,
    ForwardFn,
    Recording,
    differentiable_indices,
    flatten_outputs,
    grad_targets,
)


def _zero_grads(outputs: list[torch.Tensor], diff: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros_like(outputs[i]) for i in diff]


class EmulatedRecording(Recording):
    """A recording whose 'graphs' are the module's own forward and autograd's backward."""

    def __init__(
        self, fn: ForwardFn, static_inputs: list[torch.Tensor], params: list[torch.Tensor], warmup: int
    ) -> None:
        self._fn = fn
        self.static_inputs = static_inputs
        self.params = params
        self._targets = grad_targets(static_inputs, params)
        for _ in range(warmup):
            outs, _ = flatten_outputs(fn(*static_inputs))
            diff = differentiable_indices(outs)
            if diff:
                torch.autograd.grad(
                    [outs[i] for i in diff], self._targets, _zero_grads(outs, diff), allow_unused=True
                )
        outs, self.out_spec = flatten_outputs(fn(*static_inputs))
        self.differentiable = differentiable_indices(outs)
        self.static_outputs = [o.detach().clone() for o in outs]
        grads: Sequence[torch.Tensor | None] = [None] * len(self._targets)
        if self.differentiable and self._targets:
            grads = torch.autograd.grad(
                [outs[i] for i in self.differentiable],
                self._targets,
                _zero_grads(outs, self.differentiable),
                allow_unused=True,
            )
        self.static_grads = [None if g is None else torch.empty_like(g) for g in grads]
        self._activations: list[torch.Tensor] | None = None

    def replay_forward(self) -> None:
        with torch.enable_grad():
            outs, _ = tree_flatten(self._fn(*self.static_inputs))
        self._activations = outs  # the one set of saved activations: replaces the last forward's
        with torch.no_grad():
            for static, out in zip(self.static_outputs, outs, strict=True):
                static.data.copy_(out)  # in place and, like a graph replay, without a version bump
        self.generation += 1

    def _grad(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        assert self._activations is not None, "backward before any forward replay"
        if not indices or not self._targets:
            return [None] * len(self._targets)
        return torch.autograd.grad(
            [self._activations[i] for i in indices],
            self._targets,
            list(grads),
            retain_graph=True,
            allow_unused=True,
        )

    def backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], str | None]:
        if any(g is None for g in grads):
            return self._partial(grads), "partial"
        return self._replay_backward(grads), None  # type: ignore[arg-type]

    def _replay_backward(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        computed = self._grad(self.differentiable, grads)
        out: list[torch.Tensor | None] = []
        with torch.no_grad():
            for static, g in zip(self.static_grads, computed, strict=True):
                if static is None or g is None:
                    out.append(None)
                else:
                    static.data.copy_(g)
                    out.append(static.detach())
        return out

    def _partial(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        pairs = [(i, g) for i, g in zip(self.differentiable, grads, strict=True) if g is not None]
        return list(self._grad([i for i, _ in pairs], [g for _, g in pairs]))

    def exact_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return self._partial(grads)

    def free(self) -> None:
        self._activations = None
        self.static_outputs = []
        self.static_grads = []
        self.static_inputs = []


class EmulatedBackend(Backend):
    """Recordings with CUDA-graph buffer semantics that run on any device."""

    name = "emulated"

    def record(
        self, fn: ForwardFn, static_inputs: list[torch.Tensor], params: list[torch.Tensor], warmup: int
    ) -> Recording:
        return EmulatedRecording(fn, static_inputs, params, warmup)
