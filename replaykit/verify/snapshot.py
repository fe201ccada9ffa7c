"""Snapshot and restore of what warm-up and capture may touch: parameters, buffers, ``.grad``, RNG.

Recording runs the module several times; those runs must leave no trace (BatchNorm statistics,
attributes a forward updates or assigns, dropout's RNG, gradients), so the call that records is
bitwise equal to eager.
"""

from __future__ import annotations

import random
import sys
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from types import FunctionType, MethodType, ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from ..guards.keys import is_ndarray
from ..guards.module import hidden_modules
from ..guards.recurrent import restore_cuda_rng
from .host_generators import is_host_generator


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values in host memory (a CPU tensor's: a clone), to be copied back.
    Snapshots hold the whole training state (four times the parameters under Adam) while a step runs
    beside them: on the GPU that was an out-of-memory where eager fits."""
    if t.device.type == "cpu":
        return t.detach().clone()
    return t.detach().to("cpu", non_blocking=True)  # pinned, in stream order: read it after a sync


class StateSnapshot:
    """Values of a module's parameters and buffers, ``.grad``, RNG states, plain attributes and held
    containers.

    ``tensors=False``: attributes and containers only (a raising CUDA capture ran only Python).
    ``parameters=False``: no parameters or ``.grad`` (a run on stand-ins changes neither); ``extra``:
    the parameters it does change. ``rebinds``: a parameter or buffer whose ``.data`` a run rebound
    is bound back to its storage (the ``data_rebind`` protection).
    """

    def __init__(
        self,
        module: nn.Module,
        tensors: bool = True,
        parameters: bool = True,
        extra: Sequence[torch.Tensor] = (),
        rebinds: bool = True,
    ) -> None:
        # one walk of the tree: a recording call snapshots the whole model, and each extra walk
        # (parameters, buffers, attributes, held state) cost it about a millisecond on a 4-layer LM
        # and modules held in plain lists, tuples and dicts (``self.extra = [nn.BatchNorm1d(6)]``):
        # unregistered, but a forward that runs one updates its statistics as a registered one's
        modules = [*module.modules(), *(m for _, m in hidden_modules(module))]
        self._attributes = [(m, _plain_attributes(m)) for m in modules]
        params = _members(module, modules, "parameters") if tensors else []
        # the private host generators the walk met (None: not walked), for a call state to take
        self.host_generators: list[Any] | None = None
        if tensors:
            attr_tensors, generators, self.host_generators = held_state(
                a for _, a in self._attributes
            )
            buffers = _members(module, modules, "buffers")
            held = [*(params if parameters else extra), *buffers, *attr_tensors]
        else:
            held, generators, buffers = [], [], []
        self._values = [(t, host_copy(t)) for t in held]
        # the storage each parameter and buffer is bound to: a run that rebinds ``.data`` (MoCo's
        # ``pk.data = pk.data * m + ...``) moves no version and keeps the object, and copying the
        # values back into the new storage would leave a view of the old one behind
        bound = (*params, *buffers) if rebinds else ()
        self._bindings = [(t, t.data) for t in bound if t.layout == torch.strided]
        self._grads = (
            [(p, p.grad, None if p.grad is None else host_copy(p.grad)) for p in params]
            if parameters
            else []
        )
        self._rng = rng_states(held + params) if tensors else None
        self._host_rng = host_rng_state() if tensors else None
        # private generators the model holds: a rerun (the twin after a verification, a capture
        # retried) must draw the numbers the first run drew, as the default generator does
        self._generators = [(g, g.get_state()) for g in generators]
        self._contents = [
            (v, contents(v)) for _, attrs in self._attributes for v in attrs.values() if mutable(v)
        ]

    def restore(self) -> None:
        """Put every value back in place (same tensor objects, no autograd version bump)."""
        for m, attrs in self._attributes:
            now = _plain_attributes(m)
            for name in now.keys() - attrs.keys():
                del m.__dict__[name]
            for name, value in attrs.items():
                if now.get(name, _MISSING) is not value:
                    m.__dict__[name] = value
        for value, saved in self._contents:
            put_back(value, saved)
        with torch.no_grad():
            for t, bound in self._bindings:
                if t.data_ptr() != bound.data_ptr() or t.shape != bound.shape:
                    t.data = bound
            for t, value in self._values:
                t.data.copy_(value, non_blocking=True)  # from pinned host memory: in stream order
            for p, grad, value in self._grads:
                if p.grad is not grad:
                    p.grad = grad
                if grad is not None:
                    grad.data.copy_(value, non_blocking=True)
        for g, state in self._generators:
            g.set_state(state)
        if self._host_rng is not None:
            set_host_rng_state(self._host_rng)
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            for device, state in cuda.items():
                # not set_rng_state: it re-seeds cuDNN's RNN dropout
                restore_cuda_rng(state, device)


_MISSING = object()
_INTERNAL = ("_parameters", "_buffers", "_modules", "forward", "_replaykit_recorder")


def held_generators(module: nn.Module) -> list[torch.Generator]:
    """The torch.Generators the module's tree holds (attributes, plain objects it holds): the ones
    a snapshot puts back, so the ones a recording may register (``backends.base.Subject``)."""
    modules = [*module.modules(), *(m for _, m in hidden_modules(module))]
    return held_state(_plain_attributes(m) for m in modules)[1]


def _plain_attributes(module: nn.Module) -> dict:
    """The module's own attribute bindings, containers and hooks aside."""
    return {k: v for k, v in module.__dict__.items() if k not in _INTERNAL and "hooks" not in k}


def unique(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    """``tensors`` without ``None`` and repeats (by identity: a shared weight), in order: what
    ``parameters()`` and ``buffers()`` yield, from a walk already made."""
    seen: set[int] = set()
    return [t for t in tensors if t is not None and id(t) not in seen and not seen.add(id(t))]


def _members(module: nn.Module, modules: list[nn.Module], kind: str) -> list[torch.Tensor]:
    """``module.parameters()`` (``kind="parameters"``) or ``module.buffers()`` from the walk made,
    and those too where the model's class lists its own (a ``parameters()`` that adds a Parameter
    held in a plain list): the walk alone would leave that one unrestored, and a recording call
    that put back everything else would go on from a state eager never had."""
    walked = unique(t for m in modules for t in getattr(m, f"_{kind}").values())
    cls = type(module)
    if all(
        getattr(cls, name) is getattr(nn.Module, name)
        for name in (kind, f"named_{kind}", "_named_members")
    ):
        return walked
    return unique([*walked, *getattr(module, kind)()])


#: how far into containers and plain objects held state is looked for (a bank's queue, an
#: augmentation object's generator); a library's objects (a Trainer, an optimizer) are not entered
_DEPTH = 4
_LIBRARIES = frozenset({"torch", "numpy", "lightning", "pytorch_lightning", "lightning_fabric"})
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, ModuleType, FunctionType)


class Held(NamedTuple):
    """What :func:`held_state` finds: tensors, torch generators, private host generators."""

    tensors: list[torch.Tensor]
    generators: list[torch.Generator]
    host: list[Any]  # random.Random, numpy Generator / RandomState (verify/host_generators.py)


def held_state(roots: Iterable[dict]) -> Held:
    """The tensors (parameters aside), generators and private host generators reachable from the
    values of ``roots`` (a module's plain attributes, a function's closure) through lists, tuples,
    deques, sets, dicts and plain objects (``self.bank = Bank()``, ``self.aug = Augment()`` holding
    a generator): a rerun must find each as the first run found it. Modules are not entered
    (walked as modules)."""
    tensors: dict[int, torch.Tensor] = {}
    generators: dict[int, torch.Generator] = {}
    host: dict[int, Any] = {}
    seen: set[int] = set()
    todo: list[tuple[object, int]] = [(v, _DEPTH) for root in roots for v in root.values()]
    while todo:
        value, depth = todo.pop()
        if type(value) in _PROXIES:  # a weak proxy: not held (and a dead one raises on any look)
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(value, nn.Parameter):
                tensors.setdefault(id(value), value)
            continue
        if isinstance(value, torch.Generator):
            generators.setdefault(id(value), value)
            continue
        if is_host_generator(value):
            host.setdefault(id(value), value)
            continue
        if depth == 0 or id(value) in seen or isinstance(value, (nn.Module, MethodType, *_ATOMS)):
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            items: Iterable[object] = list(value.values())
        elif isinstance(value, (list, tuple, deque, set, frozenset)):
            items = list(value)
        elif type(value).__module__.partition(".")[0] not in _LIBRARIES:
            try:  # a plain object; one without __dict__ (or a dead weakref proxy) holds nothing here
                items = list(vars(value).values())
            except Exception:
                continue
        else:
            continue
        todo += [(v, depth - 1) for v in items]
    return Held(list(tensors.values()), list(generators.values()), list(host.values()))


def held_host_generators(modules: Iterable[nn.Module], values: Sequence[Any] = ()) -> list[Any]:
    """The private host generators the modules' plain attributes and ``values`` (what code holds)
    reach, by :func:`held_state`'s walk: the ones a recording call's state puts back."""
    roots = [*(_plain_attributes(m) for m in modules), dict(enumerate(values))]
    return held_state(roots).host


def _writable_array(value: object) -> bool:
    """A numpy array a forward could write in place; a numpy scalar (``np.linspace(...)[i]``, a
    DropBlock schedule's rate) has ``shape`` and ``tobytes`` too but is immutable: nothing to restore."""
    return is_ndarray(value) and bool(value.flags.writeable)  # type: ignore[attr-defined]


def mutable(value: object) -> bool:
    return (
        isinstance(value, (list, dict, set, deque))
        or _writable_array(value)
        or (
            hasattr(value, "__dict__")
            and not isinstance(value, (nn.Module, torch.Tensor, type))
            and not callable(value)
        )
    )


def contents(value: object) -> object:
    """A shallow copy of a container's items, or of a plain object's attributes."""
    if isinstance(value, (list, deque)):
        return list(value)
    if _writable_array(value):
        return value.copy()  # type: ignore[attr-defined]
    if isinstance(value, (dict, set)):
        return value.copy()
    return dict(vars(value))


def put_back(value: object, contents: object) -> None:
    """Undo what a forward did to a container or object the module holds (a log it appended to)."""
    if isinstance(value, list):
        value[:] = contents  # type: ignore[index]
    elif isinstance(value, deque):
        value.clear()
        value.extend(contents)  # type: ignore[arg-type]
    elif _writable_array(value):
        value[...] = contents  # type: ignore[index]
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(contents)  # type: ignore[arg-type]
    else:
        vars(value).clear()
        vars(value).update(contents)  # type: ignore[arg-type]


def tensor_attributes(module: nn.Module) -> list[torch.Tensor]:
    """Tensors held as plain attributes (neither parameters nor buffers) anywhere in the tree, and
    those held in containers or plain objects (:func:`held_state`): a forward that writes one in
    place (a running sum kept as ``self.stats = [t]``, a queue in ``self.bank``) changes state a
    rerun must find as it was."""
    # not _parameters/_buffers: those are kept already
    return held_state(_plain_attributes(m) for m in module.modules())[0]


def rng_states(
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, dict[torch.device, torch.Tensor]]:
    """The CPU generator's state and each CUDA device's (of the devices ``tensors`` live on)."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


def host_rng_state() -> tuple:
    """Python's ``random`` state, and numpy's global one when numpy is imported (nothing else drew from it)."""
    np = sys.modules.get("numpy")
    if np is None:
        return (random.getstate(),)
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return (random.getstate(), name, key.tobytes(), pos, has_gauss, gauss)


def set_host_rng_state(state: tuple) -> None:
    random.setstate(state[0])
    if len(state) > 1:
        np = sys.modules["numpy"]
        name, key, pos, has_gauss, gauss = state[1:]
        np.random.set_state(
            (name, np.frombuffer(key, dtype=np.uint32).copy(), pos, has_gauss, gauss)
        )
