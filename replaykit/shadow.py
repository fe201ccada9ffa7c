"""The shadow check: a sampled replayed call compared bit for bit with eager on the same state.

Guards cover what was foreseen; this covers the rest. With ``capture(..., check_every=N)``
every N-th replayed call (the first one included) first runs eagerly on stand-ins of the
parameters and inputs, from the same module state and RNG state, which are then put
back; the replay follows. Its outputs, the buffers and plain tensor attributes it
updated and the RNG state must equal eager's bitwise, and at the backward so must every
gradient and its None pattern. On the first difference the recorder retires with reason
``diverged: <tensor>: max abs ..., ... ulp``, and that call's result is eager's: a
forward is re-run eagerly from the restored state, a backward returns eager's gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .bitwise import diff
from .outputs import OutputTree, split_outputs
from .snapshot import StateSnapshot, rng_states, tensor_attributes


def first_difference(
    pairs: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]],
) -> str | None:
    """``"<name>: max abs A, U ulp (k of n elements)"`` for the first pair that differs bitwise."""
    for name, reference, got in pairs:
        row = diff(name, reference, got)
        if row is None:
            continue
        if row.problem != "values":
            return f"{name}: {row.problem}"
        return f"{name}: max abs {row.max_abs:.3g}, {row.max_ulp} ulp ({row.mismatched} of {row.numel} elements)"
    return None


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = [(f"buffer {n}", b) for n, b in module.named_buffers()]
    tensors += [(f"attribute {i}", t) for i, t in enumerate(tensor_attributes(module))]
    cpu, cuda = rng_states([t for _, t in tensors] + list(module.parameters()))
    return [*tensors, ("cpu rng", cpu), *((f"{d} rng", s) for d, s in cuda.items())]


class Shadow:
    """The eager twin of one replayed call, kept until that call's backward."""

    def __init__(
        self,
        module: nn.Module,
        run: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
    ) -> None:
        snapshot = StateSnapshot(module, parameters=False)  # the eager run differentiates stand-ins
        stand_ins: dict[
            int, torch.Tensor
        ] = {}  # one per distinct tensor: `q is k` stays true, as in eager
        self.inputs = [
            stand_ins.setdefault(id(x), x.detach().requires_grad_(x.requires_grad)) for x in inputs
        ]
        self.leaves = [p.detach().requires_grad_(True) for p in params]
        try:
            self.outputs, self.tree = split_outputs(
                run(*self.inputs, params=self.leaves), strict=False
            )
            self.after = [(n, t.detach().clone()) for n, t in _state(module)]
        finally:
            snapshot.restore()
        self.snapshot = snapshot

    def check_forward(
        self, module: nn.Module, outputs: Sequence[torch.Tensor], tree: OutputTree | None = None
    ) -> str | None:
        """The first difference between the replayed forward and eager, or None; with ``tree``,
        the recording's output structure and constants must be eager's too."""
        if tree is not None:
            difference = tree.difference(self.tree)
            if difference is not None:
                return difference
        pairs = [
            (f"output {i}", r.detach(), o)
            for i, (r, o) in enumerate(zip(self.outputs, outputs, strict=True))
        ]
        now = dict(_state(module))
        pairs += [(n, t, now.get(n)) for n, t in self.after]
        return first_difference(pairs)

    def reference_grads(
        self, differentiable: Sequence[int], grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Eager's gradients for the inputs requiring grad, then the parameters."""
        targets = [x for x in self.inputs if x.requires_grad] + self.leaves
        pairs = [
            (self.outputs[i], g)
            for i, g in zip(differentiable, grads, strict=True)
            if g is not None
        ]
        if not pairs:
            return [None] * len(targets)
        return list(
            torch.autograd.grad(
                [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
            )
        )

    def check_backward(
        self,
        names: Sequence[str],
        reference: Sequence[torch.Tensor | None],
        result: Sequence[torch.Tensor | None],
    ) -> str | None:
        return first_difference(zip(names, reference, result, strict=True))
