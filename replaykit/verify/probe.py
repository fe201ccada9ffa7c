"""The record-time probe: one eager forward and backward that finds what no replay can repeat.

Run once before recording, on the backends' stand-ins, it looks for what a signature cannot see
and a graph would freeze: Python effects (:mod:`replaykit.verify.side_effects`), private
generators other than the module's own (those a recording registers), host reads and data-dependent shapes
(an input-derived read is noted instead when a
:class:`~replaykit.guards.input_reads.Provenance` wraps ``fn``), sparse gradients, gradient hooks
on several parameters (a replay runs them in another order), foreign leaves requiring grad, an
input requiring grad read several times, an output aliasing an input, an object among the
outputs, and a parameter cast several times under autocast (eager's cast cache sums its uses'
gradients in low precision). Most retire the recorder; the last four route only that signature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..backends.tape import shares_state
from ..guards.grad_hooks import hooked, learn
from ..guards.signature import autocast_key
from ..memory.attribute_outputs import AttributeOutputs, Target, attribute_storages
from ..memory.outputs import OutputTree, objects, split_outputs
from .bindings import Bindings
from .dispatch import StorageReads, WatchingMode, caller, written_positions
from .dispatch import written as written_by
from .side_effects import SideEffects
from .snapshot import held_generators


@dataclass(frozen=True)
class Refusal:
    """Why a call cannot be recorded; ``scope`` is ``"module"`` (retire), ``"signature"`` (eager),
    ``"call"`` (a write into the model an eager call makes once: this call eager, a later one records)
    or ``"learn"`` (something learnt that later keys include: this call eager).

    For a signature, ``reason`` is the eager route's one word and ``detail`` says why.
    ``draws_only``: the forward's one effect was drawing from Python's or numpy's RNG (draws that
    only choose are keyed: ``guards/host_choices.py``); ``cpu_draws_only``: from torch's CPU
    generator beside a GPU model (LayerDrop's ``torch.rand([])``: learnt by ``guards/input_reads.py``).
    """

    scope: str
    reason: str
    detail: str = ""
    draws_only: bool = False
    cpu_draws_only: bool = False


@dataclass(kw_only=True)
class Findings:
    """What one probe run found, for the recording it vets: the parameters (``saved``) and input
    positions (``saved_inputs``) the backward reads, the parameters read more than once
    (``multi_use``), the output tree (``probed``), the parameters written in place, the inputs
    written in place with their version bumps, the module's own generators drawn from, the
    attribute writes recorded as outputs (and which of them are states), and the order eager's backward reaches the parameters
    in where gradient hooks need it (``grad_order``)."""

    saved: list[int] = field(default_factory=list)
    saved_inputs: list[int] = field(default_factory=list)
    multi_use: list[int] = field(default_factory=list)
    probed: list[OutputTree] = field(default_factory=list)
    written: list[torch.Tensor] = field(default_factory=list)
    written_inputs: dict[int, int] = field(default_factory=dict)
    generators: list[torch.Generator] = field(default_factory=list)
    attribute_writes: list[Target] = field(default_factory=list)
    attribute_states: set[tuple[int, str]] = field(default_factory=set)  # of those, read too
    grad_order: list[int] = field(default_factory=list)


_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_INDEX = (
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
)
_TO_COPY = torch.ops.aten._to_copy.default


def _boolean_mask(func: Any, args: tuple) -> bool:
    return func in _INDEX and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (args[1] if len(args) > 1 else ())
    )


class _Inspector(WatchingMode):
    """Notes aten ops a graph cannot repeat: private generators other than ``own`` (the module's,
    on its device: a recording registers them), host reads, data-dependent shapes. Puts each
    private generator's state back afterwards (the probe must leave no trace)."""

    def __init__(
        self, leaves: Sequence[torch.Tensor] = (), own: Sequence[torch.Generator] = ()
    ) -> None:
        super().__init__()
        # the storages of the tree's plain tensor attributes (set by the probe) and those read
        self.attributes: StorageReads | None = None
        self.generators: list[str] = []
        self._own = list(own)
        self.own: list[torch.Generator] = []  # those the forward draws from
        self.data_dependent: list[str] = []
        self._states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._leaves = {id(t): i for i, t in enumerate(leaves)}
        self._keep = list(leaves)  # the ids above stay theirs while the probe runs
        self.casts: dict[
            int, int
        ] = {}  # leaf index -> dtype casts of that leaf (autocast's, when on)
        # the storages written in place: a parameter's, through any view or ``.data``
        self.storages: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if gen is not None:
            self._states.setdefault(id(gen), (gen, gen.get_state()))
            self._note(gen, func)
        # aten.index is tagged dynamic_output_shape for its boolean masks; integer indices (a
        # gather, e.g. Swin's relative position bias) have a shape known on the host
        if _boolean_mask(func, args) or (
            func not in _INDEX and any(tag in func.tags for tag in _DATA_DEPENDENT)
        ):
            self.data_dependent.append(f"{func}{caller()}")
        if (
            func is _TO_COPY
            and args
            and id(args[0]) in self._leaves
            and kwargs.get("dtype") not in (None, args[0].dtype)
        ):
            i = self._leaves[id(args[0])]
            self.casts[i] = self.casts.get(i, 0) + 1
        if self.attributes is not None:
            self.attributes.note(args, kwargs)
        if written_positions(func):
            self.storages.update(
                t.untyped_storage().data_ptr()
                for t in written_by(func, args, kwargs)
                if t.layout == torch.strided and t.device.type != "meta"  # a sparse one has none
            )
        return self.run(func, args, kwargs)

    def _note(self, gen: torch.Generator, func: Any) -> None:
        """A draw from ``gen``: one of the module's own generators (by state: the dispatcher hands
        a new Python wrapper), or a refusal."""
        own = next((g for g in self._own if shares_state(gen, g)), None)
        if own is None:
            self.generators.append(str(func))
        elif all(g is not own for g in self.own):
            self.own.append(own)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for gen, state in self._states.values():
            gen.set_state(state)


def _uses(
    outputs: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    known: Sequence[torch.Tensor] = (),
) -> tuple[list[int], list[torch.Tensor]]:
    """How many graph edges reach each leaf's AccumulateGrad node from ``outputs``, and the
    other leaves requiring grad the graph reaches (neither ``leaves`` nor ``known``)."""
    index = {id(t): i for i, t in enumerate(leaves)}
    ours = {id(t) for t in known}
    foreign: dict[int, torch.Tensor] = {}
    counts = [0] * len(leaves)
    seen: set[int] = set()
    alive: list[Any] = []  # node wrappers can be temporaries: keep them so no id is reused
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None and id(var) in index:
                counts[index[id(var)]] += 1
            elif var is not None and id(var) not in ours:
                foreign[id(var)] = var
            elif id(nxt) not in seen:
                stack.append(nxt)
    for o in outputs:  # an input returned as is counts as a use too
        if o.grad_fn is None and id(o) in index:
            counts[index[id(o)]] += 1
    return counts, list(foreign.values())


def foreign_leaves(
    outputs: Sequence[torch.Tensor], known: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The tensors requiring grad outside ``known`` (leaves of another network) ``outputs`` reach."""
    return _uses([o for o in outputs if o.requires_grad], [], known)[1]


class _SavedParameters:
    """Saved-tensor hooks noting which parameters and inputs the backward reads (eager checks just those
    for in-place changes)."""

    def __init__(self, leaves: Sequence[torch.Tensor]) -> None:
        self._index = {t.untyped_storage().data_ptr(): i for i, t in enumerate(leaves)}
        self.saved: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        i = self._index.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if i is not None:
            self.saved.add(i)
        return (
            t.detach()
        )  # an output saved as itself would hold its own graph: a cycle gc cannot see

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _output_refusal(result: Any, outputs: list[OutputTree]) -> Refusal | None:
    """An object among the outputs routes the signature eagerly; else ``outputs`` gets their tree."""
    found = objects(result)
    if found:
        return Refusal("signature", "output_object", f"forward returns {found[0]}")
    outputs.append(split_outputs(result)[1])
    return None


def probe(
    module: nn.Module,
    fn: Callable[..., Any],
    static_inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    found: Findings,
    callers: Sequence[torch.Tensor] | None = None,
    attributes: AttributeOutputs | None = None,
    host_rng: bool = True,
    host_to: tuple | None = None,
    drawn_to: torch.Tensor | None = None,
    state_checks: tuple[bool, bool] = (True, True),
) -> Refusal | None:
    """Run ``fn`` once eagerly on stand-ins (the caller restores): why it cannot be recorded, or
    None; ``found`` receives what the run found. ``callers``: the caller's tensors behind the static
    inputs; ``attributes``: the recorder's attribute outputs; ``host_to`` / ``drawn_to``: where its
    draws leave the host generators; ``state_checks``: :class:`Bindings`' two."""
    leaves = [p.detach().requires_grad_(True) for p in params]  # sharing the storages
    effects = SideEffects(module, static_inputs, host_rng, drawn_to, host_to, callers)
    device = next((t.device.type for t in (*static_inputs, *params)), "cpu")
    inspector = _Inspector(leaves, _own_generators(module, device))
    if attributes is not None and (held := attribute_storages(module)):
        inspector.attributes = StorageReads(held)
    hooks = _SavedParameters([*leaves, *static_inputs])
    # autocast's cast cache off, as the backends record (the probe counts a recording's casts)
    autocast, dtype = autocast_key(device)
    shared_casts = autocast and torch.is_autocast_cache_enabled()
    with (
        Bindings(module, params, leaves, state_checks) as bindings,
        effects,
        torch.autocast(device, dtype=dtype, enabled=autocast, cache_enabled=False),
        inspector,
        torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack),
    ):
        result = fn(*static_inputs, params=leaves)
    tensors = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor)]
    rebuilt = _output_refusal(result, found.probed)
    del result
    _found(module, inspector, hooks, len(leaves), found)
    _inputs_written(effects, inspector, static_inputs, callers is not None, found.written_inputs)
    refusal = (
        _forward_refusal(effects, inspector, rebuilt, attributes, found, module)
        or _state_refusal(bindings, tensors)
        or _aliased_output(tensors, static_inputs)
        or (_shared_cast(module, params, inspector, dtype) if shared_casts else None)
    )
    if refusal is not None:
        return refusal
    diff = [o for o in tensors if o.requires_grad]
    del tensors
    wanting = [x for x in static_inputs if x.requires_grad]
    order = found.grad_order if hooked(params) else None
    return _backward_refusal(diff, wanting, leaves, found.multi_use, order) if diff else None


def _own_generators(module: nn.Module, device: str) -> list[torch.Generator]:
    """The generators the module holds on its device (a recording registers them)."""
    return [g for g in held_generators(module) if g.device.type == device]


def _hook_order(outputs: int) -> Refusal:
    """Gradient hooks beside several differentiable outputs, whose gradients eager may take one at
    a time: no order is learnt."""
    return Refusal(
        "module",
        f"gradient hooks beside {outputs} differentiable outputs would run in another order than eager",
    )


def _found(
    module: nn.Module,
    inspector: _Inspector,
    hooks: _SavedParameters,
    n_leaves: int,
    found: Findings,
) -> None:
    """Fill ``found``: the parameters written in place, what the backward reads, the module's own
    generators the forward draws from."""
    found.generators[:] = inspector.own
    # by storage: ``.data`` has a version counter of its own
    found.written[:] = [
        p
        for p in module.parameters()
        if p.numel() and p.untyped_storage().data_ptr() in inspector.storages
    ]
    found.saved[:] = sorted(i for i in hooks.saved if i < n_leaves)
    found.saved_inputs[:] = sorted(i - n_leaves for i in hooks.saved if i >= n_leaves)


def _inputs_written(
    effects: SideEffects,
    inspector: _Inspector,
    static_inputs: Sequence[torch.Tensor],
    back: bool,
    written_inputs: dict[int, int],
) -> None:
    """The inputs the forward wrote, by version or by storage (a write through ``.data``): into
    ``written_inputs`` where a replay writes them back exactly (``back``: the caller's tensors are
    known); else ``effects`` refuses."""
    storages = inspector.storages
    effects.also_written(
        i for i, x in enumerate(static_inputs) if x.numel() and _storage(x) in storages
    )
    if back and effects.inputs_written_back():
        written_inputs.update(effects.version_moves())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _attribute_outputs(
    attributes: AttributeOutputs | None,
    found: Findings,
    effects: SideEffects,
    inspector: _Inspector,
    module: nn.Module,
) -> Refusal | None:
    """The attribute writes a recording repeats as outputs (into ``found``), no longer effects;
    a refusal where a forward reads an assigned tensor that requires grad. A parameter's stand-in
    or a buffer assigned is no computed output (an input's is refused as an output)."""
    if attributes is None:
        return None
    # the stand-ins of the parameters, the buffers before the run (a re-bound one's new tensor is computed)
    held = (*inspector._keep, *effects.buffers_before())
    foreign = {_storage(t) for t in held if t.layout == torch.strided and t.numel()}
    writes = [*effects.changed_attributes(), *effects.changed_entries()]
    read = inspector.attributes.read if inspector.attributes is not None else set()
    outputs, states, why = attributes.sort(writes, read, foreign)
    if why is not None:
        return Refusal("module", why)
    effects.exclude(outputs)
    found.attribute_writes[:], found.attribute_states = outputs, states
    return None


def _forward_refusal(
    effects: SideEffects,
    inspector: _Inspector,
    rebuilt: Refusal | None,
    attributes: AttributeOutputs | None,
    found: Findings,
    module: nn.Module,
) -> Refusal | None:
    """What the forward did that a graph cannot repeat: a side effect (the attribute outputs
    aside), a private generator, a host read, outputs a replay cannot rebuild."""
    refusal = _attribute_outputs(attributes, found, effects, inspector, module)
    if refusal is not None:
        return refusal
    effect = effects.reason("forward")
    if effect is not None:
        only = effects.reason("forward", python_draws=False) is None
        cpu_only = effects.reason("forward", host_draws=False) is None
        scope = "call" if effects.writes_only() else "module"
        return Refusal(scope, effect, draws_only=only, cpu_draws_only=cpu_only)
    if inspector.generators:
        return Refusal(
            "module",
            f"{inspector.generators[0]} draws from a private torch.Generator the module does not hold (or on "
            "another device), which a graph would freeze",
        )
    if inspector.data_dependent:
        return Refusal(
            "module",
            f"{inspector.data_dependent[0]} reads tensor data on the host or has a data-dependent output shape "
            "(.item(), nonzero, a boolean mask): a graph would freeze it",
        )
    return rebuilt


def _aliased_output(
    tensors: list[torch.Tensor], static_inputs: Sequence[torch.Tensor]
) -> Refusal | None:
    """Eager hands back a view of the caller's tensor, a replay a static copy."""
    storages = {x.untyped_storage().data_ptr() for x in static_inputs}
    aliased = [i for i, o in enumerate(tensors) if o.untyped_storage().data_ptr() in storages]
    if aliased:
        return Refusal(
            "signature", "output_aliases_input", f"output {aliased[0]} is (a view of) an input"
        )
    return None


def _state_refusal(bindings: Bindings, tensors: list[torch.Tensor]) -> Refusal | None:
    """A parameter or buffer the forward rebound (a write into the model at that call: once is a
    new state, at every call it retires), or an output sharing one's memory (that signature eager)."""
    rebound = bindings.rebound
    if rebound is not None:
        return Refusal(
            "call",
            f"forward rebinds {bindings.qualified(rebound)} (`{rebound}.data = ...`), which a replay "
            "would not: update it in place under torch.no_grad() (`p.mul_(m).add_(q, alpha=1 - m)`), "
            "which replays",
        )
    found = bindings.returned(tensors)
    if found is None:
        return None
    i, name = found
    return Refusal(
        "signature",
        "output_aliases_state",
        f"output {i} is (a view of) {name}: eager hands back the module's own tensor, which a kept "
        "reference follows, a replay memory of its own; return a copy (`.detach().clone()`) or a "
        "value computed from it (`.exp()`)",
    )


def _shared_cast(
    module: nn.Module, params: Sequence[torch.Tensor], inspector: _Inspector, dtype: Any
) -> Refusal | None:
    """Eager: one cast per region, its uses' gradients summed in low precision before the cast back."""
    recast = {i: n for i, n in inspector.casts.items() if n > 1}
    if not recast:
        return None
    i, n = next(iter(recast.items()))
    pname = {id(p): name for name, p in module.named_parameters()}.get(
        id(params[i]), f"parameter {i}"
    )
    return Refusal(
        "signature",
        "autocast_shared_weight",
        f"{pname} is used {n} times under autocast ({dtype}): eager casts it once (autocast's cache) and sums "
        "its uses' gradients in that dtype, a recording casts per use and sums them in float32",
    )


def _backward_refusal(
    diff: list[torch.Tensor],
    wanting: list[torch.Tensor],
    leaves: list[torch.Tensor],
    multi_use: list[int] | None,
    order: list[int] | None = None,
) -> Refusal | None:
    """The backward's part: tensors outside the module, sparse gradients, an input read twice
    (``multi_use`` receives the parameters read more than once; ``order``, where hooks need
    it, the order eager's backward reaches them in)."""
    if order is not None and len(diff) > 1:
        return _hook_order(len(diff))
    uses, foreign = _uses(
        diff, [*wanting, *leaves], []
    )  # before the backward, which frees the graph as it goes
    if multi_use is not None:
        multi_use[:] = [i for i, n in enumerate(uses[len(wanting) :]) if n > 1]
    uses = uses[: len(wanting)]
    if foreign:
        return Refusal(
            "module",
            f"forward reads {len(foreign)} tensor(s) requiring grad that are not parameters of the module "
            "(a tensor attribute, a module kept in a dict): a recording would give them no gradient",
        )
    grads = torch.autograd.grad(
        diff,
        wanting + leaves,
        [torch.zeros_like(o) for o in diff],
        allow_unused=True,
        retain_graph=order is not None,
    )
    if order is not None:
        order[:] = learn(diff, leaves)
    layouts = [g.layout for g in grads if g is not None]
    del grads, diff
    sparse = [lay for lay in layouts if lay != torch.strided]
    if sparse:
        return Refusal(
            "module",
            f"a {sparse[0]} gradient (e.g. nn.Embedding(sparse=True)) cannot live in a static buffer",
        )
    reused = [i for i, n in enumerate(uses) if n > 1]
    if reused:
        n = uses[reused[0]]
        return Refusal(
            "signature",
            "input_reused",
            f"input {reused[0]} requires grad and is read {n} times; its gradient sum order could differ from eager",
        )
    return None
