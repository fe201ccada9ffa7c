"""The base of replaykit's dispatch modes: they watch code run without changing what it does.

Two things of a plain ``TorchDispatchMode`` change a run: under any mode a foreach op's in-place
write (``clip_grad_norm_``'s ``_foreach_mul_``) bumps no version counter, while outside one and on
a capturing stream it does (:meth:`WatchingMode.run` bumps it); and dynamo marks compiled frames
run under a mode without ``ignore_compile_internals`` skipped for good.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["WatchingMode", "caller", "increment_versions", "written", "written_positions"]

_POSITIONS: dict[Any, tuple[int, ...]] = {}
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the replaykit package
_PLUMBING = (  # what lies between the code that made a call and the mode that sees it
    "torch/utils/_python_dispatch.py",
    "torch/_ops.py",
    "torch/overrides.py",
    "torch/_tensor.py",
    "torch/_compile.py",
    "torch/_dynamo/",  # torch._disable_dynamo's wrapper
)
_VALIDATION = (
    " (torch.distributions' argument validation, on by default: pass validate_args=False or call "
    "torch.distributions.Distribution.set_default_validate_args(False))"
)


def caller() -> str:
    """Where the Python that reached the op being dispatched is: the innermost frame outside
    replaykit and torch's dispatch plumbing (`` at torch/distributions/distribution.py:315 in
    _validate_sample``), with the fix when it is torch.distributions' argument validation. A host
    read named only by its aten op leaves a user who wrote no ``.item()`` guessing."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if not path.startswith(_HERE.replace(os.sep, "/")) and not any(
            p in path for p in _PLUMBING
        ):
            break
        frame = frame.f_back
    if frame is None:
        return ""
    short = path[path.rfind("/torch/") + 1 :] if "/torch/" in path else os.path.basename(path)
    where = f" at {short}:{frame.f_lineno} in {frame.f_code.co_name}"
    return where + _VALIDATION if "torch/distributions/" in path else where


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


class StorageReads(WatchingMode):
    """Which of ``watched`` (storages, by data pointer) the ops of a run read: a tensor attribute
    the forward assigns without reading the old one is a recorded output, one it reads too is a
    state (``memory/attribute_outputs.py``)."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.read: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.note(args, kwargs)
        return self.run(func, args, kwargs)

    def note(self, args: tuple, kwargs: dict) -> None:
        """The watched storages among an op's tensors."""
        for t in tree_leaves((args, kwargs)):
            if (
                isinstance(t, torch.Tensor)
                and t.layout == torch.strided
                and t.device.type != "meta"
            ):
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.watched:
                    self.read.add(ptr)


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
