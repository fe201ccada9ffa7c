"""Recurrent nets (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): the private state torch keeps beside them.

``nn.RNNBase`` caches its weights in ``_flat_weights`` (with weak references,
``_flat_weight_refs``) and, at every forward, compares the cache with the module's
parameters: a parameter found changed makes the forward assign a fresh cache and call
``flatten_parameters()``, which on CUDA copies every weight into a new cuDNN buffer and
rebinds (``set_``) each weight's storage to it. A run on stand-ins for the parameters (the
recorder's probe, warm-up, capture and shadow check: detached leaves of the same storage)
is such a change: the forward's assignment read as a side effect a replay would not
repeat (so ``rk.capture`` of any recurrent net retired to eager), and on CUDA the stand-ins
were re-flattened into a buffer of the recording's own, away from the parameters.

:func:`flat_weights_follow` points each RNN's cache at the stand-ins while they stand, so
the forward sees nothing changed: no assignment, no flattening, and cuDNN reads the
parameters' own flat buffer (the stand-ins share it).

cuDNN's RNN dropout draws from a state buffer of ATen's own (a per-device cache in
``cudnn/RNN.cpp``, out of Python's reach), advanced in place by every train-mode forward
with ``dropout > 0``, and re-seeded from the CUDA generator at the first such forward after
the generator's seed was set. ``torch.cuda.set_rng_state`` sets the seed, so a snapshot's
restore of the CUDA RNG re-seeded it (measured on the H200: an eager loop with a snapshot
taken and restored before each step already differed from eager in every dropout pattern).
:func:`restore_cuda_rng` puts the generator back without that side effect. The buffer
itself is out of Python's reach but handed to ``aten._cudnn_rnn`` as its ``dropout_state``
argument: :class:`DropoutStates` copies each buffer it sees there before the op advances it,
and the call state puts it back before the call's one real run. Measured on the H200
(``scripts/gpu/rnn_dropout_try.py``): a whole step so recorded replays exactly, and so does
``rk.capture`` once its shadow check's eager rerun puts the buffer back as well
(:meth:`DropoutStates.buffers`): the rerun at the backward otherwise drew the next masks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


@contextmanager
def flat_weights_follow(module: nn.Module) -> Iterator[None]:
    """Each RNN in ``module``'s tree caches the parameters it holds now, until the block ends. Only
    flat weights that are plain ``_parameters`` entries (a parametrized one refreshes the cache in
    eager too); the caches are put back as the same objects, so no guard sees a change."""
    held = []
    for m in module.modules():
        if not isinstance(m, nn.RNNBase) or "_flat_weights" not in m.__dict__:
            continue
        params = m._parameters
        if not all(n in params for n in m._flat_weights_names):
            continue
        now = [params[n] for n in m._flat_weights_names]
        held.append((m, m.__dict__["_flat_weights"], m.__dict__.get("_flat_weight_refs")))
        m.__dict__["_flat_weights"] = now
        m.__dict__["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in now]
    try:
        yield
    finally:
        for m, weights, refs in held:
            m.__dict__["_flat_weights"] = weights
            m.__dict__["_flat_weight_refs"] = refs


def restore_cuda_rng(state: torch.Tensor, device: torch.device) -> None:
    """``torch.cuda.set_rng_state(state, device)`` without re-seeding cuDNN's RNN dropout state. The
    re-seed flag lives on the generator, seed and offset on its state object: setting them through
    ``graphsafe_get_state``'s second generator leaves the flag as eager left it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    view = getattr(generator, "graphsafe_get_state", None)
    if view is None:  # an older torch: the plain restore (it re-seeds the dropout state)
        torch.cuda.set_rng_state(state, device)
        return
    view().set_state(state)


def _cudnn_dropout_rnns(module: nn.Module) -> list[tuple[str, nn.RNNBase]]:
    """The CUDA RNNs in ``module`` whose train-mode forward draws cuDNN dropout."""
    if not torch.backends.cudnn.enabled:
        return []
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.RNNBase)
        and m.dropout
        and m.training
        and any(p.is_cuda for p in m.parameters(recurse=False))
    ]


class DropoutStates(TorchDispatchMode):
    """cuDNN's RNN dropout state buffers, each copied when ``aten._cudnn_rnn`` is first handed it
    (before the op advances it): :meth:`restore` puts them back, so the recording call's extra
    runs leave the buffer as one eager call leaves it. Not while a stream captures: a capture
    executes nothing, and a copy there would be a kernel of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._cudnn_rnn.default:
            state = _argument(func, args, kwargs, "dropout_state")
            if (
                isinstance(state, torch.Tensor)
                and state.numel()
                and state.data_ptr() not in self._seen
                and not torch.cuda.is_current_stream_capturing()
            ):
                self._seen.add(state.data_ptr())
                self._saved.append((state, state.clone()))
        return func(*args, **kwargs)

    def restore(self) -> None:
        with torch.no_grad():
            for state, copy in self._saved:
                state.copy_(copy)

    def buffers(self) -> list[torch.Tensor]:
        """The state buffers seen so far: a later eager rerun of the forward (the shadow check's)
        puts them back too, or it would draw the next masks, not the replayed call's."""
        return [state for state, _ in self._saved]


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    names = [a.name for a in func._schema.arguments]
    i = names.index(name)
    return args[i] if i < len(args) else kwargs.get(name)


def records_cudnn_dropout(module: nn.Module) -> bool:
    """Whether ``module`` draws cuDNN dropout (its state is watched and put back)."""
    return bool(_cudnn_dropout_rnns(module))


def dropout_states(module: nn.Module) -> DropoutStates | None:
    """A watcher for the recording call's runs where :func:`records_cudnn_dropout`, else None:
    nothing watched, nothing costs."""
    return DropoutStates() if records_cudnn_dropout(module) else None


def watching(states: DropoutStates | None) -> contextlib.AbstractContextManager:
    return states if states is not None else contextlib.nullcontext()
