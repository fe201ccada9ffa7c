"""The whole step checked against its eager twin on the same state, bit for bit.

Guards cover what was foreseen; code that computes differently under capture (transformers'
mask builders ask ``is_current_stream_capturing()``) or kernels chosen differently are caught
only by running the call eagerly from the same state and comparing: at every new recording's
call (the twin's end state ``E`` kept, state put back, the recording's work ``R`` must equal
``E``) and every N-th replay with ``check_every=N``. The state left is always eager's; a
difference routes the signature eager or retires the step, naming the first differing tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..guards.optimizer import restore_scaler, scaler_state, state_tensors
from .bitwise import all_equal
from .shadow import first_difference
from .snapshot import StateSnapshot, host_copy, unique

__all__ = ["StepSnapshot", "difference", "end_state", "unique"]


class StepSnapshot:
    """What one step may change, to be put back in place. ``tensors=True``: the model's
    :class:`~replaykit.verify.snapshot.StateSnapshot`, the optimizer's, scaler's and EMA's state and
    the scaler's notes; ``tensors=False`` (a raising CUDA capture ran only Python): the attributes,
    containers and the scaler's notes."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        ema: Any,
        grads_of: Sequence[torch.Tensor],
        tensors: bool,
        generators: Sequence[torch.Generator] = (),
        outside: Sequence[torch.Tensor] = (),
    ) -> None:
        self._model = StateSnapshot(model, tensors=tensors)
        self.host_generators = self._model.host_generators  # the model's walk: a call state's
        # private generators outside the model (one loss_fn closes over): drawn again by a rerun
        self._generators = [(g, g.get_state()) for g in generators] if tensors else []
        extra = ema.tensors() if ema is not None and tensors else ()
        # ``outside``: tensors outside the model the step writes (a running mean loss_fn holds)
        # parameters outside the model (an optimizer's extra group, a Parameter the model holds
        # in a plain list): their values and .grad, which a warm-up's optimizer step changes too
        inside = {id(p) for p in model.parameters()}
        others = [p for p in grads_of if id(p) not in inside] if tensors else []
        state = (
            unique([*state_tensors(optimizer, scaler, extra), *outside, *others]) if tensors else []
        )
        self._values = [(t, host_copy(t)) for t in state]
        self._grads = [(p, p.grad, None if p.grad is None else host_copy(p.grad)) for p in others]
        self._scaler, self._scaler_state = scaler, scaler_state(scaler)
        # the state entries themselves: a call that is a parameter's first step creates them
        # (momentum_buffer, exp_avg), and an eager rerun must find none, as eager did
        self._optimizer = optimizer
        self._entries = {p: dict(entry) for p, entry in optimizer.state.items()}

    def restore(self) -> None:
        self._model.restore()
        state = self._optimizer.state
        for p in list(state):
            entry = self._entries.get(p)
            if entry is None:
                del state[p]
            elif state[p].keys() != entry.keys() or any(
                state[p][k] is not v for k, v in entry.items()
            ):
                state[p].clear()
                state[p].update(entry)
        with torch.no_grad():
            for t, v in self._values:
                t.data.copy_(v, non_blocking=True)  # from pinned host memory: in stream order
            for p, grad, value in self._grads:
                p.grad = grad
                if grad is not None:
                    grad.data.copy_(value, non_blocking=True)
        for g, state in self._generators:
            g.set_state(state)
        restore_scaler(self._scaler, self._scaler_state)


def end_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    ema: Any,
    params: Sequence[torch.Tensor],
    loss: torch.Tensor,
    clone: bool,
    extra: Sequence[tuple[str, torch.Tensor]] = (),
) -> list[tuple[str, torch.Tensor | None]]:
    """Everything a step leaves, named: the loss, parameters and their gradients, buffers, the
    optimizer's, scaler's and EMA's state tensors (``clone``: copies in host memory, to outlive the
    next run: on the GPU a copy of the whole state beside the step that follows would raise the
    peak by the state's size, four times the parameters' under Adam). ``extra``: named tensors
    outside all these that the step changes (the modules ``loss_fn`` holds)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[tuple[str, torch.Tensor | None]] = [("loss", loss)]
    for i, p in enumerate(params):
        name = names.get(id(p), f"parameter {i}")
        out += [(f"parameter {name}", p), (f"grad {name}", p.grad)]
    out += [(f"buffer {n}", b) for n, b in model.named_buffers()]
    outside, extra = extra, ema.tensors() if ema is not None else ()
    out += [
        (f"optimizer/scaler/EMA state {i}", t)
        for i, t in enumerate(unique(state_tensors(optimizer, scaler, extra)))
    ]
    out += list(outside)
    if clone:
        out = [(n, None if t is None else host_copy(t)) for n, t in out]
    return out


def difference(
    replayed: list[tuple[str, torch.Tensor | None]], eager: list[tuple[str, torch.Tensor | None]]
) -> str | None:
    """The first tensor where the recorded work's end state differs bitwise from eager's, or None."""
    if [n for n, _ in replayed] != [n for n, _ in eager]:
        return "the step's state changed shape (a tensor appeared or went away)"
    if all_equal((e, r) for (_, r), (_, e) in zip(replayed, eager, strict=True)):
        return None
    return first_difference((n, e, r) for (n, r), (_, e) in zip(replayed, eager, strict=True))
