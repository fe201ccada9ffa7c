"""The base of replaykit's dispatch modes: they watch code run without changing what it does.

Three modes run around recorded code (the emulated backend's tape, the probe's inspector, the
input reads' provenance). Each must leave the run as eager would see it, and two things of a
plain ``TorchDispatchMode`` do not:

- Under any dispatch mode, a foreach op's in-place write (``torch._foreach_mul_``, which
  ``clip_grad_norm_`` uses) bumps no version counter; outside one, and on a capturing CUDA
  stream, it does. A check of inputs written in place would then pass on the CPU and fail on a
  GPU, and a forward writing its input with one would lose that write unseen.
  :meth:`WatchingMode.run` bumps what a foreach op left unbumped.
- Dynamo skips compiled frames under a mode that does not declare
  ``ignore_compile_internals``, and marks their code skipped for good: a ``torch.compile``'d
  model would run uncompiled ever after.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["WatchingMode", "written", "written_positions"]

_POSITIONS: dict[Any, tuple[int, ...]] = {}
_FOREACH_WRITES: dict[Any, bool] = {}  # per op: a foreach op that writes an argument


def written_positions(func: Any) -> tuple[int, ...]:
    """Positions of the arguments an aten op writes (in-place and ``out=`` variants); cached."""
    found = _POSITIONS.get(func)
    if found is None:
        found = tuple(
            i
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _POSITIONS[func] = found
    return found


def written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten op writes in place."""
    positions = written_positions(func)
    if not positions:
        return []
    schema = func._schema.arguments
    out: list[torch.Tensor] = []
    for i in positions:
        a = args[i] if i < len(args) else kwargs.get(schema[i].name)
        out += [t for t in tree_leaves(a) if isinstance(t, torch.Tensor)]
    return out


class WatchingMode(TorchDispatchMode):
    """A dispatch mode whose ops run as they would without it (see the module docstring)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled frames run under this mode (else dynamo skips them for good)."""
        return True

    @staticmethod
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``; a foreach op's writes get the version bump they get outside a
        mode. Only foreach ops: other ops with written arguments (batch norm's running statistics
        in cuDNN's kernel) bump nothing outside a mode either, and must not here."""
        bump = _FOREACH_WRITES.get(func)
        if bump is None:
            bump = func.__name__.startswith("_foreach_") and bool(written_positions(func))
            _FOREACH_WRITES[func] = bump
        if not bump:
            return func(*args, **kwargs)
        targets = written(func, args, kwargs)
        before = [t._version for t in targets]
        out = func(*args, **kwargs)
        unbumped = [t for t, v in zip(targets, before, strict=True) if t._version == v]
        if unbumped:
            torch._C._increment_version(unbumped)
        return out
