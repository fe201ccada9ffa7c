"""What a value keys as: the part of a recording's key that says "the code would read the same".

A graph reads tensors by address and freezes every Python value it was recorded with, so a key
holds tensors and modules by identity, *held* (:class:`Pinned`, :class:`Same`: a freed object's
``id`` is reused, and a new object must not meet the old one's key), and plain values by value.
:func:`value_key` is that rule for one value; :func:`module_key` for a module code reaches outside
any guarded tree (a teacher in a dict, a criterion, a global): its whole state, every call.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from contextvars import ContextVar
from operator import attrgetter, is_
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from .signature import PLAIN_VALUES
from .watch import CONTAINERS, in_tree

_UNSET = object()  # a ContextVar with no value and no default
SKIP = frozenset({"_replaykit_recorder", "_non_persistent_buffers_set"})
#: What a module runs instead of its class's forward: a patched ``forward``, ``module.compile()``'s
#: ``_compiled_call_impl``, a torch.compile wrapper's own. Keyed by identity (the module guard's
#: code key), never walked nor polled: dynamo's context holds inductor's config (~0.5 ms a walk).
CODE = frozenset(
    {
        "forward",
        "_forward",
        "_compiled_call_impl",
        "dynamo_ctx",
        "get_compiler_config",
        "_torchdynamo_orig_callable",
        "_torchdynamo_wrapper_id",
    }
)


class Pinned:
    """A tensor in a key, by identity, held: Python reuses a freed object's ``id``, so a script
    that re-binds a global tensor each step (``SCALE = torch.tensor(s)``) could meet its old key
    with a new tensor while the graph reads the old one's memory. A key that holds the tensor
    keeps its ``id`` from being reused while the recording keyed by it lives."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pinned) and other.tensor is self.tensor

    def __hash__(self) -> int:
        return id(self.tensor)


def value_key(value: Any) -> Any:
    """A hashable key that changes whenever ``value`` would make a forward behave differently.
    Floats are keyed by their bits (``-0.0`` is not ``0.0``; a NaN equals itself), tensors and
    callables by identity (a graph reads a tensor's memory, whatever it holds)."""
    if isinstance(value, float):
        return ("f", value.hex())
    if isinstance(value, PLAIN_VALUES):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((value_key(k), value_key(v)) for k, v in value.items()))
    if isinstance(value, complex):
        return ("c", value.real.hex(), value.imag.hex())
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(value_key(v) for v in value))
    if isinstance(value, deque):
        return ("deque", tuple(value_key(v) for v in value))
    if is_ndarray(value):  # by contents: an array updated in place keeps its identity
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, ContextVar):  # ``TEMPERATURE.get()``: the value set in this context
        return ("contextvar", id(value), value_key(value.get(_UNSET)))
    if is_numpy_generator(value):
        return ("np-rng", id(value), value_key(value.bit_generator.state))
    if isinstance(value, FunctionType):
        return _function_key(value)
    if isinstance(value, functools.partial):
        return ("partial", value_key(value.func), value_key(value.args), value_key(value.keywords))
    if isinstance(value, torch.Tensor):
        return ("tensor", Pinned(value))
    if isinstance(value, nn.Module):
        return module_key(value)
    if isinstance(value, torch.optim.Optimizer):  # code reading ``opt.param_groups[0]["lr"]``
        return ("optimizer", id(value), tuple(map(_group_key, value.param_groups)))
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):  # ``sched.last_epoch``
        return ("scheduler", id(value), value_key(_without(vars(value), "optimizer")))
    if isinstance(value, weakref.ReferenceType):
        return ("weakref", value_key(value()))
    if isinstance(value, MethodType) and isinstance(value.__self__, nn.Module):
        return ("method", Same(value.__func__), module_key(value.__self__))
    if isinstance(value, (BuiltinFunctionType, MethodType, type, ModuleType)):
        return ("id", id(value))
    attrs = getattr(value, "__dict__", None)
    if attrs is not None:
        return ("obj", id(value), value_key(attrs))
    names = slots(value)
    if names:
        return ("slots", id(value), tuple((k, value_key(getattr(value, k, None))) for k in names))
    return ("id", id(value))


def _function_key(fn: FunctionType) -> tuple:
    """By code, captured values, defaults and own attributes: a new lambda each step may reuse an
    id."""
    cells = tuple(
        value_key(c.cell_contents) if cell_filled(c) else None for c in fn.__closure__ or ()
    )
    return (
        "fn",
        id(fn.__code__),
        cells,
        value_key(fn.__defaults__),
        value_key(fn.__kwdefaults__),
        value_key(function_attributes(fn)),
    )


def function_attributes(fn: FunctionType) -> dict[str, Any]:
    """A function's own attributes (``lf.aux = 0.5``, ``lf.calls += 1``): values its code may read
    through its name. ``__wrapped__`` is code, keyed as the function is."""
    found = fn.__dict__
    return _without(found, "__wrapped__") if "__wrapped__" in found else found


def _group_key(group: dict[str, Any]) -> Any:
    """A param group's hyperparameters (``params``: the step's, by identity elsewhere)."""
    return value_key(_without(group, "params"))


def _without(d: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != name}


def module_key(m: nn.Module) -> Any:
    """A module code reaches outside a guarded tree (a teacher in a dict, a criterion, a global):
    every submodule by identity and class, its plain attributes (``training`` too) and hooks, and
    each parameter's, buffer's and tensor attribute's identity, memory, strides, shape and
    ``requires_grad`` (:class:`_Outside`). A graph reads those tensors' memory: a teacher loaded as
    new tensors, a re-bound ``.data``, a replaced head or an unfrozen weight is a new recording.
    A module of a guarded tree is keyed by identity: its guard reads the rest."""
    if in_tree(m):
        return ("tree", Same(m))
    state = _outside.get(m)
    if state is None:
        state = _outside[m] = _Outside(m)
    return ("module", Same(m), *state.key())


def outside_module(value: Any) -> bool:
    """A module held outside every guarded tree: :func:`module_key` reads it each call."""
    return isinstance(value, nn.Module) and not in_tree(value)


class _Outside:
    """One outside module's state, read on every call: a write to it need not pass ``setattr``
    (``vars(teacher)["k"] = ...``, a list inside a tuple, a closure cell), so nothing is cached
    but the last state read, held (its objects' ids stay theirs), to number it: ``version``
    counts the states met (a state met again is a new version: recorded anew, exact); the
    tensors' memory, strides, shape and ``requires_grad`` are part of every key. A read first
    asks :class:`_Seen` whether anything could have changed (identity, and the value of what can
    change in place); only then is the module read in full."""

    __slots__ = ("__weakref__", "keys", "module", "objects", "seen", "tensors", "version")

    def __init__(self, m: nn.Module) -> None:
        self.module, self.version = weakref.ref(m), 0
        self.objects: list[Any] = []  # submodules, tensors, code: compared by identity
        self.keys: list[Any] = []  # plain values: compared by value key
        self.tensors: list[torch.Tensor] = []
        self.seen: _Seen | None = None

    def key(self) -> tuple:
        m = self.module()
        busy = _keying.__dict__.setdefault("modules", set())
        if id(m) in busy:  # it holds itself: keyed by what the outer read sees
            return (self.version,)
        busy.add(id(m))
        try:
            if self.seen is None or not self.seen.unchanged():
                self._read_in_full(m)
        finally:
            busy.discard(id(m))
        tensors = self.tensors
        # changed in C, no write to see: the memory a graph reads (a re-bound or transposed
        # ``.data``), and whether autograd gives the tensor a gradient
        return (
            self.version,
            tuple(map(_data_ptr, tensors)),
            tuple(map(_stride, tensors)),
            tuple(map(_size, tensors)),
            tuple(map(_requires_grad, tensors)),
        )

    def _read_in_full(self, m: nn.Module) -> None:
        self.seen = _Seen(_submodules(m))
        objects, keys, self.tensors = self._read(self.seen)
        same = len(objects) == len(self.objects) and all(map(is_, objects, self.objects))
        if not same or keys != self.keys:
            self.objects, self.keys, self.version = objects, keys, self.version + 1

    @staticmethod
    def _read(seen: _Seen) -> tuple[list[Any], list[Any], list[torch.Tensor]]:
        """Every submodule's state (``seen`` notes what its first look polls)."""
        objects: list[Any] = []
        keys: list[Any] = []
        tensors: list[torch.Tensor] = []
        for sub in seen.modules:
            objects += (sub, type(sub))  # a class swapped runs another forward
            if in_tree(sub):  # a distiller holding the model: its guard's
                continue
            for k, v in sub.__dict__.items():
                if k in CONTAINERS or k in SKIP:
                    continue
                if "hooks" in k:  # a hook added on a teacher changes what its forward returns
                    if isinstance(v, dict):
                        keys.append((k, len(v)))
                        objects += v.values()
                        seen.hooks(v)
                    continue
                if k in CODE or isinstance(v, torch.Tensor):  # by identity (code: never walked)
                    objects.append(v)
                    keys.append(k)
                    if isinstance(v, torch.Tensor):
                        tensors.append(v)
                else:
                    keys.append((k, seen.value(v)))
            for k, t in (*sub._parameters.items(), *sub._buffers.items()):
                keys.append(k)
                objects.append(t)
                if t is not None:
                    tensors.append(t)
        return objects, keys, tensors


class _Seen:
    """What an outside module's full read saw, to tell cheaply that nothing changed since: each
    submodule's class, its ``__dict__``'s names and values and its children, parameters and
    buffers by identity (every re-binding shows there), and the value keys of the values that
    can change in place (a dict, a list, an object; a hook dict's hooks by identity). Numbers,
    strings and tuples of them cannot change in place: their identity is their state. A teacher
    of 121 modules: ~0.3 ms a call instead of ~1.5 ms in full (the development box)."""

    __slots__ = ("hook_dicts", "hooked", "modules", "mutable", "size", "subs")

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.subs = [_Sub(sub) for sub in modules]
        self.mutable: list[tuple[Any, Any]] = []
        self.hook_dicts: list[dict] = []  # mostly empty: their sizes summed, in C
        self.hooked: list[tuple[dict, list[Any]]] = []  # the others' hooks, by identity
        self.size = 0

    def value(self, v: Any) -> Any:
        """``v``'s value key, polled by the first look unless ``v`` cannot change in place."""
        key = value_key(v)
        if not _frozen(v):
            self.mutable.append((v, key))
        return key

    def hooks(self, d: dict) -> None:
        self.hook_dicts.append(d)
        self.size += len(d)
        if d:
            self.hooked.append((d, list(d.values())))

    def unchanged(self) -> bool:
        return (
            all(s.unchanged() for s in self.subs)
            and sum(map(len, self.hook_dicts)) == self.size
            and all(len(d) == len(v) and all(map(is_, d.values(), v)) for d, v in self.hooked)
            and all(value_key(v) == k for v, k in self.mutable)
        )


class _Sub:
    __slots__ = ("cls", "module", "names", "tree", "values")

    def __init__(self, sub: nn.Module) -> None:
        self.module, self.cls, self.tree = sub, type(sub), in_tree(sub)
        self.names, self.values = _names(sub), _values(sub)

    def unchanged(self) -> bool:
        sub = self.module
        if type(sub) is not self.cls or in_tree(sub) is not self.tree:
            return False
        values = _values(sub)
        return (
            len(values) == len(self.values)
            and all(map(is_, values, self.values))
            and _names(sub) == self.names
        )


def _values(sub: nn.Module) -> list[Any]:
    """A module's attributes, children, parameters and buffers (dicts written in place)."""
    return [
        *sub.__dict__.values(),
        *sub._modules.values(),
        *sub._parameters.values(),
        *sub._buffers.values(),
    ]


def _names(sub: nn.Module) -> list[str]:
    return [*sub.__dict__, *sub._modules, *sub._parameters, *sub._buffers]


_FROZEN = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device})


def _frozen(value: Any) -> bool:
    """A value that cannot change in place (a tuple of such: a kernel size)."""
    t = type(value)
    return t in _FROZEN or (t is tuple and all(map(_frozen, value)))


_outside: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: ids of the modules being read (a module that holds itself)
_keying = threading.local()
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_size = torch.Tensor.size
_requires_grad = attrgetter("requires_grad")


def _submodules(m: nn.Module) -> list[nn.Module]:
    """``m``'s tree, a guarded tree's modules not entered (their guard reads them)."""
    found, todo, seen = [], [m], set()
    while todo:
        sub = todo.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        found.append(sub)
        if sub is m or not in_tree(sub):
            todo += [c for c in reversed(sub._modules.values()) if c is not None]
    return found


class Same:
    """A key part equal only to the same object. It holds the object, so no other object takes
    its id while the key is kept (a new ``module.compile()`` must not key as the old one)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def is_ndarray(value: Any) -> bool:
    """A numpy array (numpy is not imported for this: a type check by module name)."""
    return (
        type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "shape")
    )


def is_numpy_generator(value: Any) -> bool:
    return type(value).__module__.startswith("numpy.random") and hasattr(value, "bit_generator")


def cell_filled(cell: Any) -> bool:
    """Whether a closure cell holds a value (an empty one raises on read)."""
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def slots(value: Any) -> tuple[str, ...]:
    return tuple(
        k
        for c in type(value).__mro__
        for k in getattr(c, "__slots__", ())
        if k not in ("__weakref__", "__dict__")
    )
