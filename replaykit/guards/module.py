"""Guards: the host-side values a recording depends on, noticed when they change.

A graph freezes every Python value the forward read (``training`` flags, ``dropout.p``, a
schedule attribute, what sits in ``_parameters``). Re-reading them every call costs thousands
of reads for a large tree, so writes are watched instead (:mod:`~replaykit.guards.watch`); an
unchanged tree costs one integer comparison. When the epoch moved, :meth:`ModuleGuard.refresh`
reads the tree: its plain values form the *state key* (a change records anew, a value set back
replays); swapped parameters route eager (``parameters_swapped``); a new parameter, buffer or
submodule re-records. Plain objects and containers of user code cannot report writes and are
re-read every call.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from enum import Enum
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from ..errors import ReplayWarning
from .grad_hooks import hooked
from .keys import (
    CODE,
    SKIP,
    Same,
    is_ndarray,
    is_numpy_generator,
    outside_module,
    slots,
    value_key,
)
from .signature import PLAIN_VALUES
from .watch import (
    CONTAINERS,
    HOOK_DICTS,
    epoch,
    install,
    swap_dicts,
    unwatch,
    watch,
    watchers,
)


def gradient_hooks(params: Any) -> int:
    """How many parameters carry gradient hooks (tensor hooks or post-accumulate hooks)."""
    return len(hooked(params))


def _entries_key(value: Any, entries: dict[int, dict[Any, bool]]) -> Any:
    """``value_key``, but a held dict's or plain object's learnt entries keyed by kind."""
    learnt = entries.get(id(value)) if entries else None
    if learnt is None:
        return value_key(value)
    items = value if isinstance(value, dict) else vars(value)
    inner = tuple(
        (value_key(k), _kind_key(v, learnt[k]) if k in learnt else value_key(v))
        for k, v in items.items()
    )
    return ("dict", inner) if isinstance(value, dict) else ("obj", id(value), inner)


def _state_buffers(m: nn.Module, kinds: dict[tuple[int, str], bool]) -> list[tuple[str, Any]]:
    """The module's registered buffers learnt as states (``memory/attribute_outputs.py``)."""
    return [(b, t) for b, t in m._buffers.items() if kinds.get((id(m), b))]


def _kind_key(value: Any, state: bool) -> Any:
    """An attribute the forward assigns: a tensor keyed as any tensor, the rest by value. One it
    also reads (``state``) is copied into the recording's slot before each replay: keyed by what
    the slot holds (shape, strides, dtype, device, whether it requires grad)."""
    if not isinstance(value, torch.Tensor):
        return value_key(value)
    if not state:
        return ("assigned tensor",)
    return ("state", *value.shape, value.stride(), value.dtype, value.device, value.requires_grad)


def _code_key(module: nn.Module, name: str, value: Any) -> Any:
    """The key of a :data:`CODE` attribute: what it calls, by identity. A bound method keys by
    its function and object (each attribute read makes a new one); the class's own method bound
    to the module (Lightning puts ``forward`` back so after its redirection) is None: as if unset."""
    if isinstance(value, MethodType):
        if value.__self__ is module and value.__func__ is getattr(type(module), name, None):
            return None
        return ("method", Same(value.__func__), Same(value.__self__))
    return Same(value)


def code_names(code: Any) -> set[str]:
    """The global names a code object (and the code nested in it: comprehensions, lambdas) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def _needs_polling(value: Any) -> bool:
    """Values that can change without a module ``__setattr__``: mutable containers, plain-data objects."""
    if (
        isinstance(value, (list, dict, set, deque, weakref.ReferenceType))
        or is_ndarray(value)
        or is_numpy_generator(value)
        or outside_module(value)  # a teacher kept with object.__setattr__, or its bound __call__
        or (isinstance(value, MethodType) and outside_module(value.__self__))
        or (isinstance(value, FunctionType) and value.__closure__)  # a cell a loop re-binds
        or (isinstance(value, tuple) and any(map(_needs_polling, value)))  # a list in a tuple
    ):
        return True
    if isinstance(
        value,
        (torch.Tensor, nn.Module, FunctionType, BuiltinFunctionType, MethodType, type, ModuleType),
    ):
        return False
    return (hasattr(value, "__dict__") or bool(slots(value))) and not isinstance(
        value, (Enum, *PLAIN_VALUES, float, complex, tuple)
    )


def held_values(module: nn.Module) -> list[tuple[str, Any, Any]]:
    """``(name, value, key)`` of the containers and plain objects the tree's modules hold. A write
    into one (``self.feats["h"] = h``) reports nothing, so the probe compares their keys around the
    recording forward."""
    out = []
    for n, m in module.named_modules():
        for name, value in m.__dict__.items():
            if (
                name not in SKIP
                and name not in CODE
                and name not in CONTAINERS
                and "hooks" not in name
                and _polls(m, name, value)
            ):
                try:
                    out.append((f"{n or type(m).__name__}.{name}", value, value_key(value)))
                except RecursionError:  # it refers to itself: not compared (``_unkeyable``)
                    continue
    return out


_warned_unkeyable: set[int] = set()


def _unkeyable(name: str, value: Any) -> None:
    """A plain object a module holds that refers to itself (a config whose ``owner`` is itself, a
    trainer and its module) cannot be keyed by value; as the code guard does with such a value
    (``guards/code.py``), it is keyed by identity and warned of once: a Python value read there
    is frozen at the recording call."""
    if id(value) in _warned_unkeyable:
        return
    _warned_unkeyable.add(id(value))
    warnings.warn(
        f"replaykit: {name} ({type(value).__name__}) refers to itself and cannot be keyed by value: "
        "a Python value the forward reads there is frozen at the recording call",
        ReplayWarning,
        stacklevel=2,
    )


def _is_torch_class(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.")


def _polls(module: nn.Module, name: str, value: Any) -> bool:
    """Re-read on every call: a mutable container or plain object, except torch's own private
    settings (``_reversed_padding_repeated_twice``), which nothing mutates."""
    return _needs_polling(value) and not (name.startswith("_") and _is_torch_class(module))


def hidden_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules kept outside the registered tree, in a list, tuple or dict attribute
    (a frozen teacher in ``self._teacher = [t]``), with their submodules: their ``training``
    flags and settings are read in forward just the same."""
    tree = {id(m) for m in module.modules()}
    found: dict[int, tuple[str, nn.Module]] = {}
    for n, m in module.named_modules():
        for name, value in m.__dict__.items():
            items = (
                value.values()
                if isinstance(value, dict)
                else value
                if isinstance(value, (list, tuple))
                else ()
            )
            for i, v in enumerate(items):
                if isinstance(v, nn.Module) and id(v) not in tree:
                    for sub_name, sub in v.named_modules():
                        found.setdefault(id(sub), (f"{n}.{name}[{i}].{sub_name}".rstrip("."), sub))
    return list(found.values())


# ----------------------------------------------------------------------------- the guard
class Verdict:
    """What the module tree says now: the state key, or a reason to route eager or retire."""

    __slots__ = ("eager", "key", "retire")

    def __init__(
        self, key: Any = None, eager: str | None = None, retire: str | None = None
    ) -> None:
        self.key = key
        self.eager = eager
        self.retire = retire


class ModuleGuard:
    """Watches one captured module tree; :meth:`verdict` is O(1) until something is written."""

    def __init__(self, module: nn.Module) -> None:
        install()
        self._module = module
        self._ids: list[tuple[int, weakref.ref]] = []
        self._closed = False
        # (module id, name) of attributes keyed by kind, not identity (:meth:`key_by_kind`)
        self._kinds: dict[tuple[int, str], bool] = {}  # True: a state the forward also reads
        # the same for entries of held dicts and plain objects, by the container's id
        self._entries: dict[int, dict[Any, bool]] = {}
        self._kind_owners: list[nn.Module] = []  # held: no other module takes one's id
        self.rebaseline()

    def key_by_kind(self, targets: list[tuple[Any, str]], state: bool = False) -> None:
        """Attributes the forward assigns a tensor (recorded outputs, ``memory/attribute_outputs.py``):
        keyed by what a forward could branch on without reading them (None, a number, or a
        tensor), so each call's new tensor does not record anew; ``state``: it reads the old one
        too, keyed by what its slot holds. A target held by a dict or plain object the tree holds
        (``self.feats["h"]``) is an entry of that container: keyed so within it."""
        for holder, name in targets:
            if isinstance(holder, nn.Module):
                self._kinds[(id(holder), name)] = state
            else:
                self._entries.setdefault(id(holder), {})[name] = state
        self._kind_owners += [m for m, _ in targets]
        self._seen = -1  # read the tree again at the next verdict

    def _names(self) -> Iterator[tuple[str, nn.Module]]:
        return self._module.named_modules(remove_duplicate=True)

    def rebaseline(self) -> None:
        """Take the tree as it is now as the reference for identities (done while no recording exists)."""
        self._unwatch()
        for _, m in hidden_modules(self._module):  # their writes bump the epoch too
            self._ids.append(watch(m))
        mods = list(self._names())
        for _, m in mods:
            swap_dicts(m, True)
            self._ids.append(watch(m))
        self._params = {(n, k): t for n, m in mods for k, t in m._parameters.items()}
        for t in self._params.values():
            if t is not None:
                self._ids.append(watch(t))
        self._buffers = {(n, k): t for n, m in mods for k, t in m._buffers.items()}
        self._submodules = {n: id(m) for n, m in mods}
        self._hooks = _hook_count(mods)
        self._grad_hooked = hooked(t for t in self._params.values() if t is not None)
        self._seen = -1
        self._verdict = Verdict()
        self._polled: list[tuple[Any, Any]] = []
        self._tensor_dicts: list[dict] = []  # parameters' and buffers' __dict__ (stable objects)
        self._tensor_attributes = 0
        self._interned: dict[
            tuple, int
        ] = {}  # state tuple -> small int: hashing the tuple per call would cost

    def verdict(self) -> Verdict:
        """The current state key (or why to route eager / retire): one comparison when nothing was written."""
        if (
            self._seen != epoch()
            or (self._polled and self._polled_changed())
            or sum(map(len, self._tensor_dicts)) != self._tensor_attributes
        ):
            self._seen = epoch()
            self._verdict = self.refresh()
        return self._verdict

    def _polled_changed(self) -> bool:
        entries = self._entries
        try:
            if not entries:  # every call reads here: no learnt container entries, value_key itself
                return any(value_key(v) != k for v, k in self._polled)
            return any(_entries_key(v, entries) != k for v, k in self._polled)
        except RecursionError:  # one came to refer to itself: read the tree again (refresh)
            return True

    def refresh(self) -> Verdict:
        """Read the tree: every module's plain values (the key), then identities against the baseline."""
        mods = list(self._names())
        keys = []
        polled: list[tuple[Any, Any]] = []
        kinds = self._kinds
        for _, m in mods:
            swap_dicts(m, True)  # a dict replaced wholesale (rare) is watched again
        hidden = hidden_modules(self._module)
        for n, m in [*mods, *hidden]:
            keys.append((n, "__class__", Same(type(m))))  # a class swapped: another forward
            for name, value in m.__dict__.items():
                if name in SKIP or name in CONTAINERS or "hooks" in name:
                    continue
                if name in CODE:
                    code = _code_key(m, name, value)
                    if code is not None:
                        keys.append((n, name, code))
                    continue
                kind = kinds.get((id(m), name)) if kinds else None
                try:
                    k = (
                        _entries_key(value, self._entries)
                        if kind is None
                        else _kind_key(value, kind)
                    )
                except RecursionError:  # it refers to itself: keyed as the code guard keys such
                    keys.append((n, name, ("unkeyable", id(value))))
                    _unkeyable(_dotted(n, name), value)
                    continue
                keys.append((n, name, k))
                if _polls(m, name, value):
                    polled.append((value, k))
            if kinds:  # a buffer the forward re-binds and reads (a state): keyed by its slot
                keys += [(n, b, _kind_key(t, True)) for b, t in _state_buffers(m, kinds)]
        keys += self._tensor_attribute_keys(mods, polled)
        # each object once: a transformers config, held by every layer, is read once per call
        self._polled = list({id(v): (v, k) for v, k in polled}.values())
        key = self._interned.setdefault(tuple(keys), len(self._interned))
        return Verdict(key, *self._identity(mods))

    def _tensor_attribute_keys(
        self, mods: list[tuple[str, nn.Module]], polled: list[tuple[Any, Any]]
    ) -> list[tuple]:
        """Python attributes set on a parameter or buffer (``p.decay_mult``, a buffer's
        ``.temperature``) that code reads: keyed by value and polled; one set on a tensor that had
        none shows in the dicts' summed sizes, checked every call (a few µs for 200 tensors)."""
        keys: list[tuple] = []
        self._tensor_dicts = []
        for n, m in mods:
            for k, t in (*m._parameters.items(), *m._buffers.items()):
                if t is None:
                    continue
                d = t.__dict__
                self._tensor_dicts.append(d)
                if d:
                    key = _entries_key(d, self._entries)
                    keys.append((n, k, "attributes", key))
                    polled.append((d, key))
        self._tensor_attributes = sum(map(len, self._tensor_dicts))
        return keys

    def _identity(self, mods: list[tuple[str, nn.Module]]) -> tuple[str | None, str | None]:
        """``(eager, retire)``: why the tree's tensors or submodules are not the recorded ones."""
        for n, m in mods:
            if self._submodules.get(n) != id(m):
                return None, f"submodule {n or '<root>'!r} registered anew"
        if len(mods) != len(self._submodules):
            return None, "a submodule was removed"
        if _hook_count(mods) != self._hooks:
            return None, "module hooks changed"
        if hooked(t for t in self._params.values() if t is not None) != self._grad_hooked:
            return None, "gradient hooks changed"  # a recording learnt their order (grad_hooks.py)
        for n, m in mods:
            for k, t in m._parameters.items():
                if self._params.get((n, k), t) is not t and isinstance(t, nn.Parameter):
                    return None, f"parameter {_dotted(n, k)!r} registered anew"
            for k, t in m._buffers.items():
                if self._buffers.get((n, k)) is not t and not self._kinds.get((id(m), k)):
                    # .to()/.double() replace buffers for good; a state's is keyed, not its identity
                    return None, f"buffer {_dotted(n, k)!r} replaced (storage changed)"
        if len(self._buffers) != sum(len(m._buffers) for _, m in mods):
            return None, "a buffer was removed"
        swapped = any(
            self._params.get((n, k)) is not t for n, m in mods for k, t in m._parameters.items()
        )
        if swapped or len(self._params) != sum(len(m._parameters) for _, m in mods):
            return "parameters_swapped", None  # torch.func.functional_call: until they are put back
        return None, None

    def _unwatch(self) -> None:
        unwatch(self._ids)
        self._ids = []

    def close(self) -> None:
        """Stop watching: plain dicts again, nothing global refers to the tree."""
        if self._closed:
            return
        self._closed = True
        for _, m in self._names():
            if watchers(m) <= 1:
                swap_dicts(m, False)
        self._unwatch()
        self._params, self._buffers, self._polled = {}, {}, []
        self._kinds, self._kind_owners, self._entries = {}, [], {}
        self._interned = {}  # its keys hold what the tree called (Same), a recorder's forward too


def _hook_count(mods: list[tuple[str, nn.Module]]) -> int:
    """Hooks of submodules (the root's own run outside its forward, as in eager)."""
    return sum(len(m.__dict__.get(h, ())) for _, m in mods[1:] for h in HOOK_DICTS)


def _dotted(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


def tree_contains(root: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` is ``root`` or one of its submodules."""
    return any(m is module for m in root.modules())


def host_dependence(module: nn.Module) -> str | None:
    """Why a graph would freeze a host-side value of this module, or None.

    BatchNorm with ``momentum=None`` averages with ``1 / num_batches_tracked`` read on the
    host at every call; a graph would replay the first call's factor for ever.
    """
    for name, m in module.named_modules():
        if (
            isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.momentum is None
            and m.track_running_stats
        ):
            return f"BatchNorm {name or type(m).__name__} with momentum=None reads a host-side counter every call"
    return None
