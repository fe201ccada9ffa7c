"""The base of replaykit's dispatch modes: they watch code run without changing what it does.

Two things of a plain ``TorchDispatchMode`` change a run: under any mode a foreach op's in-place
write (``clip_grad_norm_``'s ``_foreach_mul_``) bumps no version counter, while outside one and on
a capturing stream it does (:meth:`WatchingMode.run` bumps it); and dynamo marks compiled frames
run under a mode without ``ignore_compile_internals`` skipped for good.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["WatchingMode", "increment_versions", "written", "written_positions"]

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
            increment_versions(unbumped)
        return out


def increment_versions(tensors: list[torch.Tensor]) -> None:
    """Bump each tensor's version (a tensor listed twice, twice): torch 2.5+ takes a list in one
    call, torch 2.4 one tensor (a tensor alone is iterated over its rows by 2.5+)."""
    if _BATCHED_INCREMENT:
        torch._C._increment_version(tensors)
    else:
        for tensor in tensors:
            torch._C._increment_version(tensor)


try:  # probed once: torch 2.4 takes one tensor only
    torch._C._increment_version([])
    _BATCHED_INCREMENT = True
except (RuntimeError, TypeError):
    _BATCHED_INCREMENT = False
