"""The state one call of a step may change, taken once at the start of its recording call.

A recording call runs the step's Python more than once; whatever it ends in (a recording that
stands, a refusal, a retirement, a retry), it must leave exactly what one eager call leaves.
:class:`CallState` is the one owner of "put everything back", restored before the one real run
and on every outcome that does not stand. It holds the tensors (the model's values, ``.grad``,
RNG, bindings, optimizer/scaler/EMA state), the Python values the code names (cells, globals,
what they hold, modules outside the model such as a teacher), the class attributes that code
reads, the optimizer's Python, and each run's output (:mod:`.output`).

For a CUDA RNN with dropout it also holds cuDNN's RNN dropout state, found while the runs go
(:meth:`CallState.watching`).

Tensors the code holds loose (a running mean in a closure) are watched by version, not copied
(one may be a dataset): :meth:`CallState.unsaved_writes` names those written, and the run that
wrote them stands as the call.
"""

from __future__ import annotations

import contextlib
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..guards.keys import cell_filled
from ..guards.module import hidden_modules
from ..guards.recurrent import DropoutStates, dropout_states, watching
from . import weight_caches
from .host_generators import HostGenerators, forward_named
from .output import HeldOutput, WarningRegistries
from .snapshot import StateSnapshot, contents, held_host_generators, host_copy, mutable, put_back

__all__ = ["CallState"]

_EMPTY = object()
_DEPTH = 3
#: plain objects of these are not entered (a module object, a library's state is not the call's)
_LIBRARIES = frozenset(
    {
        "builtins",
        "replaykit",
        "torch",
        "numpy",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
    }
)
_SLOTS = ("_parameters", "_buffers", "_modules")


class CallState:
    """Taken once at the start of a recording call; :meth:`restore` puts everything back.
    ``tensors``: the entry point's snapshot; ``model``: what it covers; ``code``: the sources of the
    code the call runs; ``objects``: plain objects a call may re-bind (an EMA); ``whole=False``
    (``call_state`` off): the tensor snapshot alone, the private host generators found (their
    draws are still seen: ``host_generators``) but not put back."""

    def __init__(
        self,
        tensors: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        code: Iterable[Any] = (),
        objects: Iterable[Any] = (),
        whole: bool = True,
    ) -> None:
        self._tensors = tensors
        self._whole = whole
        code = [c for c in code if c is not None]
        # what the code reads (loss_fn's: every cell and global it names; a forward's: plain values
        # only, not a cache it fills, whose tensors a recording made after the call may read)
        values = [v for s in code for v in s.values()]
        modules, held = _reached(values, {id(m) for m in model.modules()})
        hidden = hidden_modules(model)
        # found whether or not they are put back: a run that moves one is a draw no replay repeats
        walked = getattr(tensors, "host_generators", None)  # the snapshot's walk of the model
        self.host_generators = _host_generators(model, hidden, modules, values, walked)
        if not whole:  # unsafe (``call_state`` off): the tensor snapshot alone
            model, optimizer, code, objects = nn.Module(), None, [], ()
            modules, held, hidden = [], [], []
        self._cells = [
            (c, c.cell_contents if cell_filled(c) else _EMPTY) for s in code for c in s.cells
        ]
        self._globals = [(g, n, g.get(n, _EMPTY)) for s in code for g, n in s.global_names]
        self._classes = _class_attributes(code)
        self.modules = modules  # outside the model: a second network's owners (memory/foreign.py)
        self._modules = [(m, StateSnapshot(m)) for m in modules]
        # which tensor or module each name is bound to: a forward that re-binds a buffer
        # (``self.center = m * self.center + ...``, DINO's centre) or adds a submodule at its
        # first call changes these dicts, not the old tensor's values
        trees = [*model.modules(), *(m for _, m in hidden)]
        trees += [s for m in modules for s in m.modules()]
        self._slots = [
            (d, dict(d))
            for m in trees
            for d in (m.__dict__.get(s) for s in _SLOTS)
            if d is not None
        ]
        # the tensors they bind (plain attributes and buffers), by identity: see rebound()
        self._bound = [(m, _tensor_bindings(m)) for o in modules for m in o.modules()]
        # their tensors, named: the judge compares them too
        self.outside = [
            (f"{type(m).__name__}[{i}] {n}", t)
            for i, m in enumerate(modules)
            for n, t in (*m.named_parameters(), *m.named_buffers())
        ]
        self._held = [(v, contents(v)) for v in held]
        self._take_optimizer(_optimizers(optimizer), objects)
        self._forward_tensors = _forward_copies(code)
        self.runs: list[HeldOutput] = []
        self._warnings = WarningRegistries() if whole else None
        self._dropout: DropoutStates | None = None

    def rebound(self) -> str | None:
        """A module outside the model (a teacher ``loss_fn`` holds) whose tensor attribute or buffer
        a run bound to another tensor (``teacher.center = 0.9 * teacher.center + ...``): a replay
        would not re-bind it. Its name, or None."""
        for m, saved in self._bound:
            now = _tensor_bindings(m)
            if now.keys() != saved.keys() or any(now[k] is not v for k, v in saved.items()):
                changed = [k for k in {*now, *saved} if now.get(k) is not saved.get(k)]
                return f"{type(m).__name__}.{sorted(changed)[0]}"
        return None

    def watching(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around the recording call's runs: the state kept outside Python's reach that a run
        hands to an op (cuDNN's RNN dropout state) is copied at its first sighting, before that
        run advances it, and :meth:`restore` puts it back (a whole call state only)."""
        if self._whole:
            self._dropout = dropout_states(model)
        return watching(self._dropout)

    def dropout_buffers(self) -> list[torch.Tensor]:
        """cuDNN's RNN dropout state buffers the runs so far handed to ``aten._cudnn_rnn``."""
        return self._dropout.buffers() if self._dropout is not None else []

    def _take_optimizer(self, optimizers: list, objects: Iterable[Any]) -> None:
        """The param groups' values, the optimizers' and ``objects``' attributes, and an inner
        optimizer's state (a Lookahead's base; the outer's is the tensor snapshot's)."""
        self._groups = [
            (o, list(o.param_groups), [dict(g) for g in o.param_groups]) for o in optimizers
        ]
        self._objects = [(o, dict(vars(o))) for o in (*optimizers, *objects) if o is not None]
        inner = optimizers[1:]
        self._entries = [(o, {p: dict(e) for p, e in o.state.items()}) for o in inner]
        self._inner = [
            (t, host_copy(t))
            for o in inner
            for e in o.state.values()
            for t in e.values()
            if isinstance(t, torch.Tensor)
        ]
        self._inner += [(t, host_copy(t)) for t in _attribute_tensors(optimizers)]

    def output(self) -> HeldOutput:
        """A new run's output, held until the call says which run stands."""
        out = HeldOutput(held=self._whole)
        self.runs.append(out)
        return out

    def stands(self, run: HeldOutput | None) -> None:
        """``run`` stands as the call's: its output is emitted, every other run's dropped (the
        warning registries as at the call's start first: its warnings register as eager's do)."""
        if self._warnings is not None:
            self._warnings.restore()
        for out in self.runs:
            if out is run:
                out.emit()
            else:
                out.drop()
        self.runs = []

    def restore(self) -> None:
        """Put back everything the call's runs changed (the same objects, values as they were)."""
        if self._whole:
            weight_caches.drop()
        for d, bound in self._slots:
            _rebind(d, bound)
        if self._warnings is not None:
            self._warnings.restore()
        self._tensors.restore()
        for _, snapshot in self._modules:
            snapshot.restore()
        for cell, value in self._cells:
            if cell_filled(cell) and isinstance(cell.cell_contents, torch.Tensor):
                continue  # a tensor a recording made after the call may read: left bound
            if value is _EMPTY:
                if cell_filled(cell):
                    del cell.cell_contents
            elif not cell_filled(cell) or cell.cell_contents is not value:
                cell.cell_contents = value
        if self._dropout is not None:
            self._dropout.restore()
        if self._whole:
            self.host_generators.restore()
        for g, name, value in self._globals:
            if isinstance(g.get(name), torch.Tensor):
                continue  # a tensor a recording made after the call may read: left bound
            if value is _EMPTY:
                g.pop(name, None)
            elif g.get(name, _EMPTY) is not value:
                g[name] = value
        _put_back_classes(self._classes)
        for value, saved in self._held:
            put_back(value, saved)
        for o, groups, saved in self._groups:
            o.param_groups[:] = groups
            for g, values in zip(groups, saved, strict=True):
                _rebind(g, values)
        for o, attrs in self._objects:
            _rebind(vars(o), attrs)
        for o, entries in self._entries:
            for p in list(o.state):
                if p not in entries:
                    del o.state[p]
            for p, e in entries.items():
                _rebind(o.state[p], e)
        with torch.no_grad():
            for t, v in self._inner:
                t.data.copy_(v, non_blocking=True)
            for t, v in self._forward_tensors:
                t.data.copy_(v, non_blocking=True)


def _host_generators(
    model: nn.Module,
    hidden: list[tuple[str, nn.Module]],
    outside: list[nn.Module],
    values: list[Any],
    walked: list[Any] | None = None,
) -> HostGenerators:
    """The private host generators the call reaches: held in the model's tree (``hidden``: the
    modules it keeps in plain containers), in what the code holds (``values``: loss_fn's cells,
    defaults, globals, bound object; ``outside``: the modules outside the model those hold, a
    criterion), or named by a ``forward`` (a global, a closure cell). ``walked``: those of the
    model's tree, found by its snapshot's walk (None: walked here)."""
    named = [*model.named_modules(), *hidden]
    tree = [m for _, m in named]
    code = [s for o in outside for s in o.modules()]
    in_code = held_host_generators(code, [*values, *forward_named(tree)])
    in_model = held_host_generators(tree) if walked is None else walked
    owners = {id(g): "loss_fn's or a forward's code" for g in in_code}
    owners |= {id(g): "the model" for g in in_model}
    return HostGenerators([*in_model, *in_code], owners, named)


def _forward_copies(code: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the tensors a forward names through globals and cells (``ForwardInputs.held_tensors``:
    ``TOTAL.add_(1.0)`` under ``no_grad``): every run of the recording call writes them, the call
    state puts them back so that the run that stands writes them once."""
    found = [t for s in code for t in getattr(s, "held_tensors", list)()]
    return [(t, host_copy(t)) for t in unique_objects(found)]


def _class_attributes(code: list[Any]) -> list[tuple[type, str, Any]]:
    """The class attributes the code reads (``type(self).calls``, ``Counters.seen``: the finders'
    ``class_attributes``), bound as now (``_EMPTY``: not on that class of the chain)."""
    found = dict.fromkeys(a for s in code for a in getattr(s, "class_attributes", ()))
    return [(cls, name, vars(cls).get(name, _EMPTY)) for cls, name in found]


def _put_back_classes(saved: list[tuple[type, str, Any]]) -> None:
    """Each class attribute bound as it was (one a run added to a subclass removed again)."""
    for cls, name, value in saved:
        now = vars(cls).get(name, _EMPTY)
        if now is value:
            continue
        if value is _EMPTY:
            delattr(cls, name)
        else:
            setattr(cls, name, value)


def _tensor_bindings(m: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a module binds by name: its plain tensor attributes and its buffers."""
    bound = {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}
    bound.update((k, v) for k, v in (m.__dict__.get("_buffers") or {}).items() if v is not None)
    return bound


def _rebind(d: dict, saved: dict) -> None:
    """``d``'s keys bound as in ``saved`` (by identity: a value left alone is not touched)."""
    if d.keys() == saved.keys() and all(d[k] is v for k, v in saved.items()):
        return
    for k in d.keys() - saved.keys():
        del d[k]
    for k, v in saved.items():
        if d.get(k, _EMPTY) is not v:
            d[k] = v


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizer and those it wraps (a Lookahead's base optimizer), one level down."""
    if optimizer is None:
        return []
    inner = [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)]
    return unique_objects([optimizer, *inner])


#: an optimizer's own attributes that other snapshots cover (or that hold no step's writes)
_OPTIMIZER_OWN = frozenset({"param_groups", "state", "defaults"})


def _attribute_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Tensors the optimizers hold as attributes beside ``state`` (Lookahead's or SWA's slow
    weights, alone or in a list, tuple or dict): a trusted step writes them in place, and the
    recording call runs the step more than once. The parameters are the tensor snapshot's."""
    params = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    found: list[torch.Tensor] = []
    for o in optimizers:
        for k, v in vars(o).items():
            if k in _OPTIMIZER_OWN:
                continue
            items = (
                v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
            )
            found += [t for t in items if isinstance(t, torch.Tensor) and id(t) not in params]
    return unique_objects(found)


def unique_objects(items: Sequence[Any]) -> list[Any]:
    seen: set[int] = set()
    return [x for x in items if id(x) not in seen and not seen.add(id(x))]


def _reached(values: list[Any], inside: set[int]) -> tuple[list[nn.Module], list[Any]]:
    """The modules outside the model that ``values`` hold (through containers and plain
    objects, a few levels down; their own submodules are theirs), and the mutable containers
    and user objects on the way."""
    modules: dict[int, nn.Module] = {}
    below: set[int] = set()  # submodules of a module found: snapshotted with it
    held: dict[int, Any] = {}
    todo = [(v, _DEPTH) for v in values]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, nn.Module):
            tree = {id(m) for m in value.modules()}
            # a module above the model (a LightningModule): its code's attributes are the sources
            if id(value) in modules or id(value) in below or tree & inside:
                continue
            modules[id(value)] = value
            below |= tree - {id(value)}
            continue
        if depth == 0 or id(value) in held or isinstance(value, torch.Tensor):
            continue
        # entered (a partial's arguments), nothing to put back
        if isinstance(value, (tuple, frozenset)):
            todo += [(v, depth - 1) for v in value]
            continue
        if not mutable(value):
            continue
        if isinstance(value, dict):
            items: list[Any] = list(value.values())
        elif isinstance(value, (list, set, deque)):
            items = list(value)
        elif _library(value):
            continue
        else:
            items = list(vars(value).values())
        held[id(value)] = value
        todo += [(v, depth - 1) for v in items]
    return [m for i, m in modules.items() if i not in below], list(held.values())


def _library(value: Any) -> bool:
    """An object of a library, the standard library or replaykit (a module object, a step, a
    Trainer): not entered. A user's objects are: their class's module is not installed."""
    name = type(value).__module__
    root = name.partition(".")[0]
    if root in _LIBRARIES or root in sys.stdlib_module_names:
        return True
    path = getattr(sys.modules.get(name), "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path
