"""Writes to modules, noticed: the epoch every guard compares before reading anything.

Re-reading a large tree's values every call costs thousands of reads, so *writes* are watched:
one process-wide ``nn.Module.__setattr__``/``__delattr__`` wrapper, dict subclasses for a watched
module's ``_parameters``, ``_buffers``, ``_modules`` and hook dicts (``functional_call`` and
``ModuleList.append`` write them directly), and ``Tensor.register_hook`` wrappers all bump one
epoch. A guarded tree's dicts say so (:func:`in_tree`). A module outside every tree is not
watched: what keys it (``keys.module_key``) reads it in full on every call.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter, OrderedDict
from typing import Any

import torch
from torch import nn

CONTAINERS = ("_parameters", "_buffers", "_modules")
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

_counter = itertools.count(1)
_state = {"epoch": 0}  # bumped (from the counter) on every watched write
_watched: Counter[int] = Counter()  # id(module) or id(parameter) -> number of guards watching it
#: the object behind each watched id: an id outlives its object (a guard never closed, its model
#: collected), and a new object given that id (a loss module built inside a forward) is not watched
_objects: dict[int, Any] = {}


def _tensor_ref() -> None:
    """What stands for a watched tensor in ``_objects``: a weak reference would make
    ``torch.utils.swap_tensors`` refuse the parameter. An id a later tensor takes costs at most a
    needless refresh (a hook registered on it bumps the epoch)."""


def watch(obj: Any) -> tuple[int, Any]:
    """Count one more guard watching ``obj``; the returned handle undoes exactly that count."""
    i = id(obj)
    ref = _objects.get(i)
    if isinstance(obj, torch.Tensor):
        if ref is not _tensor_ref:
            _watched[i] = 0
            ref = _objects[i] = _tensor_ref
    elif ref is None or ref() is not obj:
        # the count of a collected object at this address (its guard never closed) is not obj's:
        # left, close() would keep obj's dicts swapped for a watcher that is gone
        _watched[i] = 0
        ref = _objects[i] = weakref.ref(obj)
    _watched[i] += 1
    return i, ref


def is_watched(obj: Any) -> bool:
    ref = _objects.get(id(obj)) if id(obj) in _watched else None
    return ref is not None and (ref is _tensor_ref or ref() is obj)


_local = threading.local()  # .writes: list of (module, name) while a probe listens


def epoch() -> int:
    """The global write epoch: changes whenever a watched module or one of its dicts is written."""
    return _state["epoch"]


def bump() -> None:
    _state["epoch"] = next(_counter)


class _WatchedDict(dict):
    """A module's ``_parameters``/``_buffers``/``_modules`` dict that reports writes."""

    __slots__ = ("__weakref__",)
    tree = True  # in_tree: a guarded tree's module

    def __setitem__(self, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value)
        bump()

    def __delitem__(self, key: Any) -> None:
        dict.__delitem__(self, key)
        bump()

    def pop(self, *args: Any) -> Any:
        bump()
        return dict.pop(self, *args)

    def popitem(self) -> Any:
        bump()
        return dict.popitem(self)

    def clear(self) -> None:
        bump()
        dict.clear(self)

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self, *args, **kwargs)
        bump()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        bump()
        return dict.setdefault(self, key, default)

    def __reduce__(self) -> tuple:  # pickles and deep-copies as a plain dict
        return (dict, (dict(self),))


class _WatchedHooks(OrderedDict):
    """A module's hook dict that reports writes (hooks would not run inside a replay)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        OrderedDict.__setitem__(self, key, value)
        bump()

    def __delitem__(self, key: Any) -> None:
        OrderedDict.__delitem__(self, key)
        bump()

    def __reduce__(self) -> tuple:
        return (OrderedDict, (list(self.items()),))


_original_setattr = nn.Module.__setattr__
_original_delattr = nn.Module.__delattr__


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    _original_setattr(self, name, value)
    if is_watched(self):
        bump()
        writes = getattr(_local, "writes", None)
        if writes is not None:
            writes.append((self, name))


def _delattr(self: nn.Module, name: str) -> None:
    _original_delattr(self, name)
    if is_watched(self):
        bump()


def _watch_hooks(register: Any) -> Any:
    """A ``Tensor.register_*hook`` that reports hooks put on watched parameters."""

    def wrapper(self: torch.Tensor, hook: Any) -> Any:
        handle = register(self, hook)
        if is_watched(self):
            bump()
        return handle

    wrapper.__wrapped__ = register  # type: ignore[attr-defined]
    wrapper.__doc__ = register.__doc__
    return wrapper


def install() -> None:
    if nn.Module.__setattr__ is not _setattr:
        nn.Module.__setattr__ = _setattr  # type: ignore[method-assign]
        nn.Module.__delattr__ = _delattr  # type: ignore[method-assign]
        for name in ("register_hook", "register_post_accumulate_grad_hook"):
            setattr(torch.Tensor, name, _watch_hooks(getattr(torch.Tensor, name)))


def swap_dicts(module: nn.Module, watched: bool) -> None:
    """Swap the module's container and hook dicts for watched ones (or back), keeping their contents."""
    d = module.__dict__
    for name in CONTAINERS:
        cls = _WatchedDict if watched else dict
        if name in d and type(d[name]) is not cls:
            d[name] = cls(d[name])
    for name in HOOK_DICTS:
        cls = _WatchedHooks if watched else OrderedDict
        if name in d and type(d[name]) is not cls:
            d[name] = cls(d[name])


class listen_for_writes:
    """Collect ``(module, attribute)`` assignments on watched modules inside the block (one thread)."""

    def __enter__(self) -> list[tuple[nn.Module, str]]:
        self._previous = getattr(_local, "writes", None)
        _local.writes = []
        return _local.writes

    def __exit__(self, *exc: object) -> None:
        _local.writes = self._previous


def unwatch(handles: list[tuple[int, Any]]) -> None:
    """Undo exactly the counts ``handles`` (from :func:`watch`) took."""
    for i, ref in handles:
        if _objects.get(i) is not ref:  # the address holds another object now: not ours
            continue
        _watched[i] -= 1
        if _watched[i] <= 0:
            del _watched[i]
            _objects.pop(i, None)


def watchers(obj: Any) -> int:
    """How many guards watch ``obj``."""
    return _watched.get(id(obj), 0)


def in_tree(m: nn.Module) -> bool:
    """``m`` belongs to a guarded tree (its dicts are the tree's watched ones)."""
    return getattr(type(m.__dict__.get("_parameters")), "tree", False)
