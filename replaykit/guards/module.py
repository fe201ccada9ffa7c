"""Guards: the host-side values a recording depends on, noticed when they change.

A graph freezes every Python value the forward read (``training`` flags, ``dropout.p``, a
schedule attribute, what sits in ``_parameters``). Re-reading them every call costs thousands
of reads for a large tree, so *writes* are watched instead: one process-wide
``nn.Module.__setattr__``/``__delattr__`` wrapper, dict subclasses for the watched modules'
``_parameters``, ``_buffers``, ``_modules`` and hook dicts (``functional_call`` writes them
directly), and ``Tensor.register_hook`` wrappers all bump one epoch; an unchanged module costs
one integer comparison. When the epoch moved, :meth:`ModuleGuard.refresh` reads the tree: its
plain values form the *state key* (a change records anew, a value set back replays); swapped
parameters route eager (``parameters_swapped``); a new parameter, buffer or submodule
re-records. Plain objects and containers of user code cannot report writes and are re-read
every call.
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from enum import Enum
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from ..errors import ReplayWarning
from .grad_hooks import hooked
from .signature import PLAIN_VALUES

#: Dict-valued module attributes that are containers, not values the forward reads.
_CONTAINERS = ("_parameters", "_buffers", "_modules")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_SKIP = frozenset({"_replaykit_recorder", "_non_persistent_buffers_set"})
#: What a module runs instead of its class's forward: a patched ``forward``, ``module.compile()``'s
#: ``_compiled_call_impl``, a torch.compile wrapper's own. Keyed by identity (:func:`_code_key`),
#: never walked nor polled: dynamo's context holds inductor's config (~0.5 ms a call to walk).
_CODE = frozenset(
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

_epoch = itertools.count(1)
_state = {"epoch": 0}  # bumped (from the counter) on every watched write
_watched: Counter[int] = Counter()  # id(module) or id(parameter) -> number of guards watching it
#: the object behind each watched id: an id outlives its object (a guard never closed, its model
#: collected), and a new object given that id (a loss module built inside a forward) is not watched
_objects: dict[int, weakref.ref] = {}


def _watch(obj: Any) -> tuple[int, weakref.ref]:
    """Count one more guard watching ``obj``; the returned handle undoes exactly that count."""
    i = id(obj)
    ref = _objects.get(i)
    if ref is None or ref() is not obj:
        # the count of a collected object at this address (its guard never closed) is not obj's:
        # left, close() would keep obj's dicts swapped for a watcher that is gone
        _watched[i] = 0
        ref = _objects[i] = weakref.ref(obj)
    _watched[i] += 1
    return i, ref


def _is_watched(obj: Any) -> bool:
    ref = _objects.get(id(obj)) if id(obj) in _watched else None
    return ref is not None and ref() is obj


_local = threading.local()  # .writes: list of (module, name) while a probe listens


def epoch() -> int:
    """The global write epoch: changes whenever a watched module or one of its dicts is written."""
    return _state["epoch"]


def _bump() -> None:
    _state["epoch"] = next(_epoch)


class _WatchedDict(dict):
    """A module's ``_parameters``/``_buffers``/``_modules`` dict that reports writes."""

    __slots__ = ("__weakref__",)

    def __setitem__(self, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value)
        _bump()

    def __delitem__(self, key: Any) -> None:
        dict.__delitem__(self, key)
        _bump()

    def pop(self, *args: Any) -> Any:
        _bump()
        return dict.pop(self, *args)

    def popitem(self) -> Any:
        _bump()
        return dict.popitem(self)

    def clear(self) -> None:
        _bump()
        dict.clear(self)

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self, *args, **kwargs)
        _bump()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        _bump()
        return dict.setdefault(self, key, default)

    def __reduce__(self) -> tuple:  # pickles and deep-copies as a plain dict
        return (dict, (dict(self),))


class _WatchedHooks(OrderedDict):
    """A module's hook dict that reports writes (hooks would not run inside a replay)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        OrderedDict.__setitem__(self, key, value)
        _bump()

    def __delitem__(self, key: Any) -> None:
        OrderedDict.__delitem__(self, key)
        _bump()

    def __reduce__(self) -> tuple:
        return (OrderedDict, (list(self.items()),))


_original_setattr = nn.Module.__setattr__
_original_delattr = nn.Module.__delattr__


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    _original_setattr(self, name, value)
    if _is_watched(self):
        _bump()
        writes = getattr(_local, "writes", None)
        if writes is not None:
            writes.append((self, name))


def _delattr(self: nn.Module, name: str) -> None:
    _original_delattr(self, name)
    if _is_watched(self):
        _bump()


def _watch_hooks(register: Any) -> Any:
    """A ``Tensor.register_*hook`` that reports hooks put on watched parameters."""

    def wrapper(self: torch.Tensor, hook: Any) -> Any:
        handle = register(self, hook)
        if _is_watched(self):
            _bump()
        return handle

    wrapper.__wrapped__ = register  # type: ignore[attr-defined]
    wrapper.__doc__ = register.__doc__
    return wrapper


def _install() -> None:
    if nn.Module.__setattr__ is not _setattr:
        nn.Module.__setattr__ = _setattr  # type: ignore[method-assign]
        nn.Module.__delattr__ = _delattr  # type: ignore[method-assign]
        for name in ("register_hook", "register_post_accumulate_grad_hook"):
            setattr(torch.Tensor, name, _watch_hooks(getattr(torch.Tensor, name)))


def gradient_hooks(params: Any) -> int:
    """How many parameters carry gradient hooks (tensor hooks or post-accumulate hooks)."""
    return len(hooked(params))


def _swap_dicts(module: nn.Module, watched: bool) -> None:
    """Swap the module's container and hook dicts for watched ones (or back), keeping their contents."""
    d = module.__dict__
    for name in _CONTAINERS:
        cls = _WatchedDict if watched else dict
        if name in d and type(d[name]) is not cls:
            d[name] = cls(d[name])
    for name in _HOOK_DICTS:
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


# ----------------------------------------------------------------------------- value keys


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
    if _is_numpy_generator(value):
        return ("np-rng", id(value), value_key(value.bit_generator.state))
    if isinstance(
        value, FunctionType
    ):  # by code and captured values: a new lambda each step may reuse an id
        cells = tuple(
            value_key(c.cell_contents) if cell_filled(c) else None for c in value.__closure__ or ()
        )
        return (
            "fn",
            id(value.__code__),
            cells,
            value_key(value.__defaults__),
            value_key(value.__kwdefaults__),
        )
    if isinstance(value, functools.partial):
        return ("partial", value_key(value.func), value_key(value.args), value_key(value.keywords))
    if isinstance(value, torch.Tensor):
        return ("tensor", Pinned(value))
    if isinstance(value, (nn.Module, BuiltinFunctionType, MethodType, type, ModuleType)):
        return ("id", id(value))
    attrs = getattr(value, "__dict__", None)
    if attrs is not None:
        return ("obj", id(value), value_key(attrs))
    slots = _slots(value)
    if slots:
        return ("slots", id(value), tuple((k, value_key(getattr(value, k, None))) for k in slots))
    return ("id", id(value))


def _tensor_slots(m: nn.Module) -> tuple:
    """``m``'s own parameters and buffers by identity, held (:class:`Pinned`)."""
    return tuple(
        (k, Pinned(t)) for k, t in (*m._parameters.items(), *m._buffers.items()) if t is not None
    )


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


class _Same:
    """A key part equal only to the same object. It holds the object, so no other object takes
    its id while the key is kept (a new ``module.compile()`` must not key as the old one)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _code_key(module: nn.Module, name: str, value: Any) -> Any:
    """The key of a :data:`_CODE` attribute: what it calls, by identity. A bound method keys by
    its function and object (each attribute read makes a new one); the class's own method bound
    to the module (Lightning puts ``forward`` back so after its redirection) is None: as if unset."""
    if isinstance(value, MethodType):
        if value.__self__ is module and value.__func__ is getattr(type(module), name, None):
            return None
        return ("method", _Same(value.__func__), _Same(value.__self__))
    return _Same(value)


def is_ndarray(value: Any) -> bool:
    """A numpy array (numpy is not imported for this: a type check by module name)."""
    return (
        type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "shape")
    )


def _is_numpy_generator(value: Any) -> bool:
    return type(value).__module__.startswith("numpy.random") and hasattr(value, "bit_generator")


def code_names(code: Any) -> set[str]:
    """The global names a code object (and the code nested in it: comprehensions, lambdas) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def cell_filled(cell: Any) -> bool:
    """Whether a closure cell holds a value (an empty one raises on read)."""
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _slots(value: Any) -> tuple[str, ...]:
    return tuple(
        k
        for c in type(value).__mro__
        for k in getattr(c, "__slots__", ())
        if k not in ("__weakref__", "__dict__")
    )


def _needs_polling(value: Any) -> bool:
    """Values that can change without a module ``__setattr__``: mutable containers, plain-data objects."""
    if (
        isinstance(value, (list, dict, set, deque))
        or is_ndarray(value)
        or _is_numpy_generator(value)
    ):
        return True
    if isinstance(
        value,
        (torch.Tensor, nn.Module, FunctionType, BuiltinFunctionType, MethodType, type, ModuleType),
    ):
        return False
    return (hasattr(value, "__dict__") or bool(_slots(value))) and not isinstance(
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
                name not in _SKIP
                and name not in _CODE
                and name not in _CONTAINERS
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
        _install()
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
            self._ids.append(_watch(m))
        mods = list(self._names())
        for _, m in mods:
            _swap_dicts(m, True)
            self._ids.append(_watch(m))
        self._params = {(n, k): t for n, m in mods for k, t in m._parameters.items()}
        for t in self._params.values():
            if t is not None:
                self._ids.append(_watch(t))
        self._buffers = {(n, k): t for n, m in mods for k, t in m._buffers.items()}
        self._submodules = {n: id(m) for n, m in mods}
        self._hooks = _hook_count(mods)
        self._grad_hooked = hooked(t for t in self._params.values() if t is not None)
        self._seen = -1
        self._verdict = Verdict()
        self._polled: list[tuple[Any, Any]] = []
        self._interned: dict[
            tuple, int
        ] = {}  # state tuple -> small int: hashing the tuple per call would cost

    def verdict(self) -> Verdict:
        """The current state key (or why to route eager / retire): one comparison when nothing was written."""
        if self._seen != _state["epoch"] or (self._polled and self._polled_changed()):
            self._seen = _state["epoch"]
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
            _swap_dicts(m, True)  # a dict replaced wholesale (rare) is watched again
        hidden = hidden_modules(self._module)
        for n, m in [*mods, *hidden]:
            for name, value in m.__dict__.items():
                if name in _SKIP or name in _CONTAINERS or "hooks" in name:
                    continue
                if name in _CODE:
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
        # a teacher held in a dict, its weights loaded as new tensors: the graph reads the old ones
        keys += [(n, "tensors", _tensor_slots(m)) for n, m in hidden]
        self._polled = polled
        key = self._interned.setdefault(tuple(keys), len(self._interned))
        return Verdict(key, *self._identity(mods))

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
        for i, ref in self._ids:
            if _objects.get(i) is not ref:  # the address holds another object now: not ours
                continue
            _watched[i] -= 1
            if _watched[i] <= 0:
                del _watched[i]
                _objects.pop(i, None)
        self._ids = []

    def close(self) -> None:
        """Stop watching: plain dicts again, nothing global refers to the tree."""
        if self._closed:
            return
        self._closed = True
        for _, m in self._names():
            if _watched.get(id(m), 0) <= 1:
                _swap_dicts(m, False)
        self._unwatch()
        self._params, self._buffers, self._polled = {}, {}, []
        self._kinds, self._kind_owners, self._entries = {}, [], {}
        self._interned = {}  # its keys hold what the tree called (_Same), a recorder's forward too


def _hook_count(mods: list[tuple[str, nn.Module]]) -> int:
    """Hooks of submodules (the root's own run outside its forward, as in eager)."""
    return sum(len(m.__dict__.get(h, ())) for _, m in mods[1:] for h in _HOOK_DICTS)


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
