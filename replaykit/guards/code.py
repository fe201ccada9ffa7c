"""What code reads besides tensors, keyed on every call: a whole step's ``loss_fn`` and a
captured module's ``forward``.

A recording runs ``loss_fn`` once, so every Python value it read is frozen into the graph (a
focal loss's annealed ``gamma``, a loss weight in a closure or global). :class:`LossInputs` finds
once where such values live: closure cells, defaults and named globals (of the code it leads
to too, a few levels deep: functions, what decorators wrap, and the methods, properties, static
and class methods the code reaches by attribute name on the classes of what it holds), a bound
method's object, a ``partial``'s arguments, an ``nn.Module`` criterion's plain attributes;
:meth:`LossInputs.key` reads them each call
(:func:`~replaykit.guards.module.value_key`), so a changed value records anew and a value set
back replays. What is guarded elsewhere is skipped; what cannot be inspected (a C function) is
listed in ``unwatched`` and named in a warning at construction.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import nn

from ..errors import ReplayWarning
from ..verify.snapshot import held_state
from .keys import Pinned, cell_filled, function_attributes, module_key, value_key
from .module import code_names

_DEPTH = 3  # functions reached through functions: helpers of helpers, not the whole program
#: keyed by identity (a tensor's memory is what a graph reads; a module object, a class: code)
_SKIPPED = (torch.Tensor, ModuleType, type)
#: torch's objects that hold a schedule code may read (``sched.last_epoch``, ``opt.param_groups[0]
#: ["lr"]``, a ``Normal``'s ``scale`` re-bound): keyed by their state (``value_key``), not identity
_STATEFUL = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.distributions.Distribution,
)


class LossInputs:
    """Where ``loss_fn``'s host values live; ``key()`` is their values now."""

    _values_only = False  # ForwardInputs: key plain values only, not code

    def __init__(self, loss_fn: Callable[..., Any] | None, model: nn.Module) -> None:
        self._model_ids = {id(m) for m in model.modules()}
        self._seen: set[int] = set()
        self._attributes: set[tuple[int, str]] = set()  # (module, attribute) keyed already
        self._sources: list[tuple[str, Callable[[], Any]]] = []
        self._raw: list[Callable[[], Any]] = []  # the same sources' values as they are
        # where the code binds names (closure cells, (globals, name); a forward's: those holding
        # plain values only): a recording call's reruns put them back
        self.cells: list[Any] = []
        self.global_names: list[tuple[dict, str]] = []
        # the class attributes the code reads, on every class of the chain that may hold one
        # (``type(self).calls += 1`` binds ``calls`` on the subclass): the reruns put them back
        self.class_attributes: list[tuple[type, str]] = []
        # their sources' names (what ``changed(classes=True)`` limits itself to)
        self._class_sources: set[str] = set()
        self._iterators: list[tuple[str, Callable[[], Any]]] = []  # sources holding an iterator
        # the attribute names tried on each class (``_class_code``), and what is keyed already
        # (a global several functions name, a base class's attribute two subclasses inherit)
        self._resolved: dict[type, set[str]] = {}
        self._keyed_at: set[tuple[int, str]] = set()
        # every name the walked code reads (a whole step's loss_fn: ``model.aux_weight()``)
        self.names: set[str] = set()
        # the user's functions walked: their attributes are keyed, and put back by the call state
        self.functions: list[FunctionType] = []
        self.unwatched: list[str] = []
        if loss_fn is not None:
            self._walk(loss_fn, "loss_fn", 0)
            self._check_sources()

    def _check_sources(self) -> None:
        """A value that cannot be keyed is named in ``unwatched``, not guessed at."""
        for name, read in list(self._sources):
            try:
                read()
            except (RecursionError, TypeError, ValueError) as exc:
                self._sources.remove((name, read))
                self.unwatched.append(f"{name} ({type(exc).__name__})")

    def key(self) -> tuple:
        """The values ``loss_fn`` would read now. A source that became unkeyable since it was
        found (``self`` of a loss, once ``self`` holds the step: its walk comes back round) is
        named in ``unwatched`` from then on, as one unkeyable from the start is, and warned of."""
        try:
            return tuple(read() for _, read in self._sources)
        except (RecursionError, TypeError, ValueError):
            before = len(self.unwatched)
            self._check_sources()
            warnings.warn(
                f"replaykit: what the code reads through {', '.join(self.unwatched[before:])} can "
                "no longer be keyed: a Python value read there is frozen at the recording call",
                ReplayWarning,
                stacklevel=2,
            )
            return tuple(read() for _, read in self._sources)

    def changed(self, before: tuple, classes: bool = False) -> str | None:
        """The first source whose value differs from ``before`` (a key taken earlier), or None.
        ``classes``: class attributes only (``type(self).calls``, ``Counters.seen``)."""
        for (name, read), old in zip(self._sources, before, strict=True):
            if (not classes or name in self._class_sources) and read() != old:
                return name
        return None

    def iterators(self) -> list[str]:
        """The sources that hold an iterator or generator now (``itertools.count()``, a generator,
        an open file): ``next()`` moves it, and its position can be neither copied nor put back."""
        return [name for name, get in self._iterators if isinstance(_get(get), Iterator)]

    # ----------------------------------------------------------------- finding the sources
    def _add(self, name: str, get: Callable[[], Any]) -> None:
        found = _get(get)
        if _registry_key(found) is not _MISSING and _plain_defaults(found):  # code: by identity
            self._sources.append((name, lambda: self._code_value(get())))
        else:
            self._sources.append((name, lambda: self._value(get())))
        self._raw.append(get)
        if isinstance(_get(get), Iterator):
            self._iterators.append((name, get))

    def generators(self) -> list[torch.Generator]:
        """The private ``torch.Generator`` objects ``loss_fn`` reads, held directly or in what its
        sources hold (a default argument, a partial's keywords, a callable criterion's attribute,
        a dict in a closed-over object): a rerun of the body (after verification's eager half, a
        capture retried) must find them as the first run did."""
        return held_state([self._values_now()])[1]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors ``loss_fn`` holds the same way (a running statistic it writes in place)."""
        return held_state([self._values_now()])[0]

    def values(self) -> list[Any]:
        """What the code holds now, source by source (a criterion, a teacher module, a closed-over list)."""
        return list(self._values_now().values())

    def _values_now(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for i, get in enumerate(self._raw):
            try:
                values[str(i)] = get()
            except Exception:  # named in ``unwatched`` already
                continue
        return values

    def _code_value(self, value: Any) -> Any:
        """A registry's key while it holds code only, else its value's."""
        found = _registry_key(value)
        return self._value(value) if found is _MISSING else found

    def _value(self, value: Any) -> Any:
        if isinstance(value, nn.Module):
            return ("model", id(value)) if id(value) in self._model_ids else module_key(value)
        if isinstance(value, torch.Tensor):
            return ("tensor", Pinned(value))
        if isinstance(value, _STATEFUL):
            return value_key(value)
        if isinstance(value, _SKIPPED) or type(value).__module__.startswith("torch."):
            return ("id", id(value))
        return value_key(value)

    def _walk(self, fn: Any, name: str, depth: int) -> None:
        if id(fn) in self._seen or depth > _DEPTH:
            return
        self._seen.add(id(fn))
        if isinstance(fn, FunctionType):
            wrapped = fn.__dict__.get("__wrapped__")
            if wrapped is not None:  # a decorated function: the code it wraps is the user's
                self._walk(wrapped, name, depth)
                if _library(_home(fn)):
                    return  # ``@torch.no_grad()``'s wrapper: torch's code, torch's globals
            self._function(fn, name, depth)
        elif isinstance(fn, MethodType):
            if self._holds_model(fn.__self__):
                self._owner(fn.__self__, fn.__func__, f"{name}.__self__")
            else:
                self._add(f"{name}.__self__", lambda: fn.__self__)
            self._walk(fn.__func__, name, depth)
            if isinstance(fn.__func__, FunctionType):  # ``self.coef()`` inside the method
                self._class_code(type(fn.__self__), code_names(fn.__func__.__code__), depth + 1)
        elif isinstance(fn, functools.partial):
            self._add(f"{name} (partial arguments)", lambda: (fn.args, fn.keywords))
            self._walk(fn.func, name, depth)
        elif isinstance(fn, nn.Module):
            if id(fn) not in self._model_ids:
                self._add(name, lambda: fn)
                self._walk(type(fn).forward, f"{type(fn).__name__}.forward", depth + 1)
                self.held_class(type(fn))  # ``Focal.gamma``, ``type(self).calls += 1``
                self._class_code(type(fn), ("forward",), depth + 1)
        elif isinstance(fn, BuiltinFunctionType) or not hasattr(fn, "__dict__"):
            if depth == 0:
                self.unwatched.append(
                    f"{name} ({type(fn).__name__}: its Python cannot be inspected)"
                )
        elif callable(fn) and not isinstance(fn, type):
            self._add(name, lambda: fn)
            self._walk(type(fn).__call__, f"{type(fn).__name__}.__call__", depth + 1)
            self.held_class(type(fn))  # a callable criterion's class defaults and counters
            self._class_code(type(fn), ("__call__",), depth + 1)

    def _holds_model(self, obj: Any) -> bool:
        """``obj`` is a module above the model (a LightningModule holding ``self.net``)."""
        return (
            isinstance(obj, nn.Module)
            and id(obj) not in self._model_ids
            and any(id(m) in self._model_ids for m in obj.modules())
        )

    def _owner(self, owner: nn.Module, func: FunctionType, name: str) -> None:
        """A method of the module that holds the model (a LightningModule's ``compute_loss``). That
        module's ``__dict__`` is mostly its framework's (a Trainer, growing logs): only the
        attributes its code names are keyed (``self.aux_weight``), with those of its own class's
        methods it calls, a few levels deep."""
        cls, names, todo, seen = type(owner), set(), [func], set()
        for _ in range(_DEPTH + 1):
            found: list[FunctionType] = []
            for f in todo:
                if id(f) in seen:
                    continue
                seen.add(id(f))
                for n in code_names(f.__code__):
                    names.add(n)
                    method = getattr(cls, n, None)
                    if isinstance(method, FunctionType) and not _library(method.__module__):
                        found.append(method)
            todo = found
        held = (owner.__dict__, owner._modules, owner._parameters, owner._buffers)
        for attr in sorted(names):
            if any(attr in d for d in held) or isinstance(getattr(cls, attr, None), property):
                self._add(f"{name}.{attr}", lambda a=attr: _read(owner, a))

    def _function(self, fn: FunctionType, name: str, depth: int) -> None:
        code = fn.__code__
        names = code_names(code)
        self.names |= names
        if not _library(_home(fn)):  # ``lf.aux``, ``scaled.scale``: read through its own name
            if not self.functions:  # one source for all: most have none (a check each per call)
                self._add("the attributes of the functions it runs", self._function_attributes)
            self.functions.append(fn)
        for var, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            filled = cell_filled(cell)
            if filled and isinstance(cell.cell_contents, ModuleType):
                # ``import helpers`` inside the function that defines the loss: as a global's
                self._module_attributes(cell.cell_contents, names, depth)
            if not self._values_only or (filled and self._keyed(cell.cell_contents)):
                self.cells.append(cell)
                self._add(
                    f"{name}'s closure variable {var!r}",
                    lambda cell=cell: cell.cell_contents if cell_filled(cell) else None,
                )
            if filled:
                self._follow(cell.cell_contents, f"{var}", depth, names)
        if (fn.__defaults__ or fn.__kwdefaults__) and not self._values_only:
            self._add(f"{name}'s defaults", lambda: (fn.__defaults__, fn.__kwdefaults__))
        globals_ = fn.__globals__
        for global_name in sorted(names):
            if global_name in globals_:
                value = globals_[global_name]
                if isinstance(value, ModuleType):
                    self._module_attributes(value, names, depth)
                if self._once((id(globals_), global_name)) and (
                    not self._values_only or self._keyed(value)
                ):
                    self.global_names.append((globals_, global_name))
                    self._add(f"global {global_name!r}", lambda g=globals_, n=global_name: g.get(n))
                self._follow(value, global_name, depth, names)

    def _function_attributes(self) -> tuple:
        """The functions' own ``__dict__`` (not copies: the call state puts them back in place)."""
        return tuple(f.__dict__ for f in self.functions if f.__dict__)

    def _once(self, where: tuple[int, str]) -> bool:
        """Whether ``where`` (a namespace's id and a name) is keyed for the first time: a global
        that several functions name, a base class's attribute, is read once per call."""
        if where in self._keyed_at:
            return False
        self._keyed_at.add(where)
        return True

    def _keyed(self, value: Any) -> bool:
        """A value a forward names that is keyed (``ForwardInputs``: plain values and tensors)."""
        return _plain(value)

    def _module_attributes(self, module: ModuleType, names: set[str], depth: int) -> None:
        """``settings.SCALE`` or ``helpers.scaled(x)`` through an imported module of the user's: its plain
        attributes that the code names are keyed, its functions walked. A library's (torch, numpy, the
        standard library) are not: they are not a schedule, and walking them would cost every call."""
        # a flag read from the environment (``os.environ["FLAG"]``, ``os.getenv``)
        if module is os and names & {"environ", "getenv"} and self._once((id(os), "environ")):
            self._add("os.environ", lambda: dict(os.environ))
        if _library(module.__name__):
            return
        for attr in sorted(names):
            value = getattr(module, attr, _MISSING)
            if value is _MISSING or (id(module), attr) in self._attributes:
                continue
            self._attributes.add((id(module), attr))
            if _plain(value):
                self._add(
                    f"{module.__name__}.{attr}",
                    lambda module=module, attr=attr: getattr(module, attr, None),
                )
            else:
                self._follow(value, f"{module.__name__}.{attr}", depth, names)

    def _follow(self, value: Any, name: str, depth: int, names: Iterable[str] = ()) -> None:
        """Functions and criteria reached from a closure cell, a global or a module's attribute are
        walked too (a library's functions are not: see ``_module_attributes``), and the code
        ``names`` (what the reaching code reads as attributes) resolve to on an object's or a
        class's class: ``sched.p()``, ``sched.p`` (a property), ``Sched.p()`` (a static method)."""
        if isinstance(value, (FunctionType, MethodType, functools.partial)):
            func = getattr(value, "__func__", getattr(value, "func", value))
            if not _library(getattr(func, "__module__", None) or ""):
                self._walk(value, name, depth + 1)
        elif isinstance(value, nn.Module) and id(value) not in self._model_ids:
            self._walk(type(value).forward, f"{type(value).__name__}.forward", depth + 1)
            self.held_class(type(value))  # a criterion's ``gamma = 2.0`` on its class
            self._class_code(type(value), names, depth + 1)
        elif isinstance(value, type) and issubclass(value, torch.autograd.Function):
            self._autograd_function(value, depth)
        elif isinstance(value, type) and not _library(value.__module__):
            if id(value) not in self._seen:
                self._seen.add(id(value))  # a user's class the code names (``Counters.seen += 1``)
                self._class_values(value)
            self._class_code(value, names, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (ModuleType, type)):
            self.held_class(type(value))  # ``cfg.temperature`` read from ``Config`` itself
            self._class_code(type(value), names, depth + 1)

    def _class_code(self, cls: type, names: Iterable[str], depth: int) -> set[str]:
        """Walk the code that ``names`` resolve to on a user's class (its methods, static and class
        methods, properties' getters and setters, what their decorators wrap), then the names that
        code reads on it in turn (``self.helper()`` inside a method): a global ``_EPOCH`` read by
        ``self.sched.p()`` is keyed as one the caller names. Each (class, name) is tried once per
        walk, and ``_DEPTH`` bounds the functions reached from there. Returns the names read."""
        reads: set[str] = set()
        if depth > _DEPTH or _library(getattr(cls, "__module__", None) or ""):
            return reads
        tried = self._resolved.setdefault(cls, set())
        todo = [n for n in names if n not in tried]
        while todo:
            attr = todo.pop()
            if attr in tried:
                continue
            tried.add(attr)
            for fn in _code_of(_class_attribute(cls, attr)):
                self._walk(fn, f"{cls.__name__}.{attr}", depth)
                found = code_names(fn.__code__)
                reads |= found
                todo += found - tried
        return reads

    def held_class(self, cls: type) -> None:
        """Key the plain class attributes of a user's class that the code reaches through an object
        or a class it holds: ``cfg.temperature`` falls back to ``Config.temperature`` while the
        instance has no value of its own, and ``self.cfg = Config`` holds the class itself. A script
        that sets ``Config.temperature = 4.0`` writes neither the instance nor the module, so only
        this key sees it (a recording would replay the old value)."""
        if id(cls) in self._seen or _library(cls.__module__):
            return
        self._seen.add(id(cls))
        self._class_values(cls)

    def _class_values(self, cls: type) -> None:
        """A user class's plain class attributes (along its MRO, up to torch's classes), keyed. An
        enum's are its members, which cannot be re-bound, and a library's base (``abc``'s,
        ``collections.abc``'s) holds no schedule."""
        if issubclass(cls, enum.Enum):
            return
        chain = []
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch.") or klass is object:
                break
            if _library(klass.__module__):
                continue
            chain.append(klass)
            for k, v in vars(klass).items():
                if _class_value(k, v) and self._once((id(klass), k)):
                    self._add(f"{klass.__name__}.{k}", lambda klass=klass, k=k: vars(klass).get(k))
                    self._class_sources.add(f"{klass.__name__}.{k}")
        self._class_attributes(chain)

    def _class_attributes(self, chain: list[type]) -> None:
        """Every (class, name) of ``chain`` for the plain names found along it."""
        names = {k for klass in chain for k, v in vars(klass).items() if _class_value(k, v)}
        known = set(self.class_attributes)
        self.class_attributes += [
            (klass, k) for klass in chain for k in sorted(names) if (klass, k) not in known
        ]

    def _autograd_function(self, cls: type, depth: int) -> None:
        """A custom ``autograd.Function`` the code applies: a graph freezes its backward's Python
        too (a gradient reversal's ``lambd`` class attribute), so its class values and the code of
        its ``forward`` and ``backward`` are walked like the caller's."""
        if id(cls) in self._seen or _library(cls.__module__):
            return
        self._seen.add(id(cls))
        self._class_values(cls)
        for name in ("forward", "setup_context", "backward"):
            fn = vars(cls).get(name)
            fn = getattr(fn, "__func__", fn)
            if isinstance(fn, FunctionType):
                self._function(fn, f"{cls.__name__}.{name}", depth + 1)


_MISSING = object()
_LIBRARIES = frozenset({"torch", "numpy", "lightning", "pytorch_lightning"})


def _library(module_name: str) -> bool:
    """A module of torch, numpy, Lightning or the standard library: no user schedule lives there."""
    root = module_name.partition(".")[0]
    return root in _LIBRARIES or root in sys.stdlib_module_names


def iterator_reason(who: str, name: str) -> str:
    """Why code that holds an iterator runs eagerly, before any run (each run would draw from it)."""
    return (
        f"{who}'s code holds an iterator or generator ({name}): next() moves it, its position can be "
        "neither copied nor put back, and a replay would not move it; every call runs eagerly"
    )


def _get(get: Callable[[], Any]) -> Any:
    """A source's value, None where reading it raises (named in ``unwatched`` already)."""
    try:
        return get()
    except Exception:
        return None


def _read(owner: object, attr: str) -> Any:
    """An attribute or property as the code reads it; one that raises is keyed by its error."""
    try:
        return getattr(owner, attr)
    except Exception as exc:  # a property that raises here raises alike in the loss
        return ("raises", type(exc).__name__)


class ForwardInputs(LossInputs):
    """What a captured tree's own classes read outside the tree: their plain class attributes
    (``type(self).SCALE``) and the plain-value globals and closure cells their ``forward`` code
    names (a module-level ``TEMPERATURE``), or code it reaches names (``self.sched.p()``, a
    property, a submodule's method, a decorated helper), and which code each class's names are:
    a script that rebinds one (``Model.forward = f``) runs other code, which a recording of the
    old would replay. torch's own classes keep none; other functions, classes and modules are not keyed
    (rebinding one is not a schedule), so a tree of torch's classes costs one empty check per call."""

    def __init__(self, module: nn.Module, calls: Iterable[str] = ()) -> None:
        """``calls``: the names a whole step's ``loss_fn`` reads; what they reach on the tree's
        classes (``model.aux_weight()``) is the model's code, keyed as what its forward reaches."""
        self._values_only = True
        super().__init__(None, module)
        reads: dict[type, set[str]] = {}  # the attribute names each class's code reads
        for name, m in module.named_modules():
            cls = type(m)
            if cls not in reads:
                reads[cls] = self._own_class(cls, calls)
            # functions the tree holds as attributes (a schedule handed in: ``self.scale = fn``)
            for k, v in m.__dict__.items():
                if isinstance(v, (FunctionType, MethodType, functools.partial)):
                    self._follow(v, f"{name or cls.__name__}.{k}", 0)
                elif isinstance(v, type) and not issubclass(v, nn.Module):
                    self.held_class(v)  # config-as-class: ``self.cfg = Config``
                    self._class_code(v, reads[cls], 2)  # ``self.cfg.scale()``, static
                elif hasattr(v, "__dict__") and not isinstance(v, (nn.Module, ModuleType)):
                    self.held_class(type(v))  # a held config object's class defaults
                    self._class_code(type(v), reads[cls], 2)  # ``self.sched.p()``, ``.p``
            for child in m._modules.values():  # ``self.gate.rate()``: a submodule's method
                if child is not None:
                    self._class_code(type(child), reads[cls], 2)
        self._check_sources()

    def _own_class(self, cls: type, calls: Iterable[str]) -> set[str]:
        """Key a tree's class: its plain class attributes, the code its ``forward`` (and a step's
        ``calls``) runs on it (methods, properties, static and class methods called through
        ``self``, and what they read), and which code each of those names is. Returns the names
        that code reads."""
        if cls.__module__.startswith("torch."):
            return set()
        self._class_values(cls)
        reads = self._class_code(cls, ("forward", *calls), 1)
        # by identity, held (no id reuse): a script that rebinds one (``Model.act = f``) runs
        # other code; a dict lookup per method and call
        for attr in ("forward", *sorted(reads.union(calls))):
            found = _class_attribute(cls, attr)
            if attr == "forward" or _code_of(found):
                get = _class_attribute if isinstance(found, classmethod) else getattr
                self._sources.append((f"{cls.__name__}.{attr}", functools.partial(get, cls, attr)))
        return reads

    def _keyed(self, value: Any) -> bool:
        """Plain values, and tensors by identity: a module-level tensor the script re-binds
        (``SCALE = torch.tensor(s)``) is another input, and a graph reads the old one's memory."""
        return _plain(value) or _loose_tensor(value) or self._outside(value)

    def _outside(self, value: Any) -> bool:
        """A module outside the tree (a global teacher): :func:`module_key` reads its state."""
        return isinstance(value, nn.Module) and id(value) not in self._model_ids

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors the forward names through globals and closure cells (a running total it adds
        to in place under ``no_grad``): the recording call's extra runs write them too, so its call
        state copies them and puts them back before the one run that stands."""
        found = [g.get(n) for g, n in self.global_names]
        found += [c.cell_contents for c in self.cells if cell_filled(c)]
        return [t for t in found if _loose_tensor(t) and not t.is_inference()]


def _class_attribute(cls: type, name: str) -> Any:
    """What ``cls.<name>`` resolves to, as stored (a descriptor is not bound anew)."""
    for klass in cls.__mro__:
        found = vars(klass).get(name)
        if found is not None:
            return found
    return None


_CAPTURED = frozenset({str, int, bool, type(None)})  # immutable, equal only when the same
_CODE = (type, FunctionType, BuiltinFunctionType)


def _class_value(name: str, value: Any) -> bool:
    """A class attribute that is data, not a dunder or ``abc``'s cache (``_abc_impl``)."""
    return not name.startswith("__") and name != "_abc_impl" and _plain(value)


def _code_entry(value: Any) -> Any:
    """A registry entry's key: a class or builtin itself; a function itself with its defaults and
    what it captures when that is a string, an int, None or code (a decorator's wrapper captures
    the function and its settings); ``_MISSING`` for anything else (data, keyed by value: a float
    too, which ``value_key`` tells from ``-0.0``). Defaults are checked once (``_plain_defaults``)."""
    if (
        type(value) is FunctionType
        and value.__kwdefaults__ is None
        and not function_attributes(value)
    ):
        if value.__closure__ is None:
            return (value, value.__defaults__)
        cells = tuple(c.cell_contents if cell_filled(c) else None for c in value.__closure__)
        if all(type(c) in _CAPTURED or isinstance(c, _CODE) for c in cells):
            return (value, value.__defaults__, cells)
        return _MISSING
    return value if isinstance(value, (type, BuiltinFunctionType)) else _MISSING


def _plain_defaults(value: Any) -> bool:
    """A registry whose functions' defaults are numbers, strings, None, dtypes, devices or code:
    a tuple of those cannot change in place, so the tuple itself is keyed."""
    found = value.values() if type(value) is dict else value
    return all(
        type(d) in _CAPTURED or isinstance(d, (float, torch.dtype, torch.device, *_CODE))
        for f in found
        if type(f) is FunctionType
        for d in f.__defaults__ or ()
    )


def _registry_key(value: Any) -> Any:
    """A dict, list or tuple of code only (transformers' ``LOSS_MAPPING``, an attention registry, a
    user's ``ACTIVATIONS = {"relu": F.relu}``), keyed entry by entry (the key holds them: no id
    reuse); ``_MISSING`` for anything else. ``value_key`` keys each function by nested keys of its
    code, defaults and captured values: a few microseconds each, every call, for tables of dozens."""
    if type(value) is dict:
        entries = tuple(map(_code_entry, value.values()))
        keys: tuple = tuple(value)
    elif type(value) in (list, tuple):
        entries, keys = tuple(map(_code_entry, value)), ()
    else:
        return _MISSING
    if not entries or _MISSING in entries:
        return _MISSING
    return ("code", type(value), keys, entries)


def _home(fn: FunctionType) -> str:
    """The module whose code ``fn`` runs: a ``functools.wraps`` wrapper takes the ``__module__``
    of what it wraps, but its globals are its own."""
    return fn.__globals__.get("__name__") or ""


def _code_of(attr: Any) -> list[FunctionType]:
    """The user's functions a class attribute runs when code calls or reads it: a method, a static
    or class method's function, a property's getter, setter and deleter, a ``cached_property``'s
    function, each with what its decorators wrap (``__wrapped__``); a library's are left out."""
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    if isinstance(attr, property):
        parts: tuple[Any, ...] = (attr.fget, attr.fset, attr.fdel)
    elif isinstance(attr, functools.cached_property):
        parts = (attr.func,)
    else:
        parts = (attr,)
    found = []
    for fn in parts:
        for _ in range(_DEPTH + 1):  # a decorator's chain, bounded
            if not isinstance(fn, FunctionType):
                break
            if not _library(_home(fn)):
                found.append(fn)
            fn = fn.__dict__.get("__wrapped__")
    return found


def cpu_versions(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """The CPU tensors among ``tensors`` (what a forward names beside a GPU model), with their
    versions: a CUDA graph does not replay a host op that writes one."""
    return [(t, t._version) for t in tensors if t.device.type == "cpu"]


def _loose_tensor(value: Any) -> bool:
    """A tensor that is not a parameter (the model's are guarded by the module's own key)."""
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


def _plain(value: Any) -> bool:
    """A value a forward reads as data (not code, a module, a class or a descriptor)."""
    return not (
        callable(value)
        or isinstance(
            value, (ModuleType, type, nn.Module, torch.Tensor, property, staticmethod, classmethod)
        )
        or hasattr(value, "__get__")
    )
