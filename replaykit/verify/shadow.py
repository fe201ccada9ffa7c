"""The shadow check: a sampled replayed call compared bit for bit with eager on the same state.

Guards cover what was foreseen; this covers the rest. With ``check_every=N`` every N-th replayed
call first runs eagerly on stand-ins from the same state, which is then put back; the replay's
outputs, buffers, RNG and, at the backward, every gradient and its None pattern must equal
eager's. A difference retires the recorder (``diverged: ...``) and that call's result is eager's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..guards.signature import autocast_key
from ..memory.layout import copy_into, same_layout
from ..memory.outputs import OutputTree, split_outputs
from . import weight_caches
from .bitwise import diff
from .output import HeldOutput
from .snapshot import StateSnapshot, held_generators, rng_states, tensor_attributes


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
    # the module's own generators: a recording registers those its forward draws from
    own = [(f"generator {i}", g.get_state()) for i, g in enumerate(held_generators(module))]
    return [*tensors, ("cpu rng", cpu), *((f"{d} rng", s) for d, s in cuda.items()), *own]


class Shadow:
    """The eager twin of one replayed call: its outputs and end state at the forward, its gradients at
    the backward.

    It keeps no autograd graph between the two (beside the recording's activations that doubled
    the first replay's peak on the H200): at the backward eager's forward reruns from the same state
    and is differentiated there; the rerun must reproduce the first bitwise, or the check fails.
    """

    def __init__(
        self,
        module: nn.Module,
        run: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        written: Sequence[torch.Tensor] = (),
        held: Sequence[torch.Tensor] = (),
        inputs_written: Sequence[int] = (),
        rebinds: bool = True,
    ) -> None:
        # the eager run differentiates stand-ins: only the parameters the forward writes in place
        # (``written``, found by the probe) change, and those are kept to be put back; ``held``:
        # tensors outside the module the forward names (a global total it adds to), put back too
        self._written = list(written)
        self._kept = [*self._written, *held]
        self._rebinds = rebinds  # a parameter's ``.data`` a run rebinds is bound back (data_rebind)
        snapshot = StateSnapshot(module, parameters=False, extra=self._kept, rebinds=rebinds)
        # one per distinct tensor: `q is k` stays true, as in eager
        stand_ins: dict[int, torch.Tensor] = {}
        # private copies (same layout): an input written in place after the forward must not change the rerun
        self.inputs = [
            stand_ins.setdefault(id(x), same_layout(x).requires_grad_(x.requires_grad))
            for x in inputs
        ]
        # the inputs the forward writes in place: as they were (a rerun, the call run eagerly
        # after a difference start from them), and as eager left them (compared with the replay's)
        self._fresh = [(i, same_layout(self.inputs[i])) for i in inputs_written]
        self.leaves = [p.detach().requires_grad_(True) for p in params]
        self._params = list(params)
        self._versions: list[int] | None = None  # as the replayed forward leaves them
        self._run = run
        self._autocast = [(d, autocast_key(d)) for d in ("cpu", "cuda")]
        try:
            with torch.enable_grad():
                outputs, self.tree = split_outputs(self._forward(), strict=False)
            self.outputs = [o.detach() for o in outputs]
            self.after = [(n, t.detach().clone()) for n, t in self._state(module)]
            self._written_after = [(i, self.inputs[i].detach().clone()) for i, _ in self._fresh]
        finally:
            snapshot.restore()
        self.snapshot = snapshot

    def _state(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What the forward leaves besides its outputs: buffers, attributes, RNG, and the
        parameters it writes in place."""
        if not self._written:
            return _state(module)
        names = {id(p): n for n, p in module.named_parameters()}
        written = [(f"parameter {names.get(id(p), '?')} (written)", p) for p in self._written]
        return [*_state(module), *written]

    def _forward(self) -> Any:
        """Eager's forward on the stand-ins, under the autocast state of the forward call (the
        backward runs on autograd's thread, which has none of its own)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(weight_caches.uncached())
            for device, (enabled, dtype) in self._autocast:
                if enabled or torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            return self._run(*self.inputs, params=self.leaves)

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """The inputs the forward writes in place, as they were before it (``tensors``: the
        caller's, written back by the replay; else the stand-ins, for a rerun)."""
        for i, fresh in self._fresh:
            copy_into(tensors[i], fresh)

    def check_forward(
        self,
        module: nn.Module,
        outputs: Sequence[torch.Tensor],
        tree: OutputTree | None = None,
        inputs: Sequence[torch.Tensor] = (),
    ) -> str | None:
        """The first difference between the replayed forward and eager, or None; with ``tree``,
        the recording's output structure and constants must be eager's too; ``inputs``: the
        caller's tensors, whose written ones must hold what eager wrote."""
        # a parameter changed after this (one the backward does not read): eager's rerun vouches for nothing
        self._versions = [p._version for p in self._params]
        if tree is not None:
            difference = tree.difference(self.tree)
            if difference is not None:
                return difference
        pairs = [
            (f"output {i}", r, o)
            for i, (r, o) in enumerate(zip(self.outputs, outputs, strict=True))
        ]
        now = dict(self._state(module))
        pairs += [(n, t, now.get(n)) for n, t in self.after]
        if inputs:
            pairs += [(f"input {i} (written)", t, inputs[i]) for i, t in self._written_after]
        return first_difference(pairs)

    def reference_grads(
        self,
        module: nn.Module,
        differentiable: Sequence[int],
        grads: Sequence[torch.Tensor | None],
        current: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> tuple[list[torch.Tensor | None] | None, str | None]:
        """Eager's gradients for the inputs requiring grad, then the parameters, and whether the
        rerun of eager's forward differed from the first run (then no gradient can be trusted).
        ``current``: the inputs the backward reads (position, the caller's tensor) as they are at the
        backward; eager's saved tensors read them so, whatever wrote them since the forward.

        ``(None, None)``: a parameter changed in place since the replayed forward (one the backward
        does not read: eager allows it), so eager's forward cannot be rerun; nothing was compared.
        """
        targets = [x for x in self.inputs if x.requires_grad] + self.leaves
        if all(g is None for g in grads):
            return [None] * len(targets), None
        if self._versions is None or [p._version for p in self._params] != self._versions:
            return None, None
        # the state as the replay (and since) left it
        now = StateSnapshot(module, parameters=False, extra=self._kept, rebinds=self._rebinds)
        self.snapshot.restore()
        self.put_back(self.inputs)
        try:
            # a rerun: what it prints or logs is the first run's again, not shown (verify/output.py)
            with torch.enable_grad(), HeldOutput().held():
                outputs = split_outputs(self._forward(), strict=False)[0]
            again = first_difference(
                (f"output {i} (eager rerun)", r, o.detach())
                for i, (r, o) in enumerate(zip(self.outputs, outputs, strict=True))
            )
            if again is not None:
                return [None] * len(targets), f"eager is not repeatable: {again}"
            for i, held in current:  # without a version bump, as a rewrite eager does not see
                copy_into(self.inputs[i], held)
            pairs = [
                (outputs[i], g) for i, g in zip(differentiable, grads, strict=True) if g is not None
            ]
            with torch.enable_grad():
                reference = torch.autograd.grad(
                    [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
                )
            return list(reference), None
        finally:
            now.restore()

    def check_backward(
        self,
        names: Sequence[str],
        reference: Sequence[torch.Tensor | None],
        result: Sequence[torch.Tensor | None],
    ) -> str | None:
        return first_difference(zip(names, reference, result, strict=True))
