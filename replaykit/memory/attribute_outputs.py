"""Tensors a forward assigns to module attributes: recorded as outputs, assigned after each replay.

A replay runs no Python, so it would not repeat ``self.aux_loss = ...`` (an MoE layer's
load-balancing loss, added to the loss by the caller) or ``self.last_attn = attn.detach()``
(kept for logging). When the forward assigns a tensor it computed to a plain attribute of a
module in the captured tree, and no op of the forward reads the tensor the attribute held before
(written, never read), that tensor is one more output of the recording: its static buffer,
copy-out, autograd (``model.aux_loss`` backpropagates into the replayed backward) and the
verification are the outputs', and after each replay the attribute is bound to the replayed
tensor, a new tensor object per call, as eager's assignment makes. An entry a forward sets in
a dict or a plain object a module holds (``self.feats["h"] = h``, ``self.state.last = out``) is
an attribute of that container here: a target is a module and a name, or a container and a key.

The probe finds such writes (:mod:`replaykit.verify.probe`); the first call that makes one runs
eagerly (``first_write``) and teaches it. From then on the module guard keys that attribute by
what a forward could branch on without reading it (None, or a tensor), not by identity: each
call's new tensor does not record anew.

A forward that reads the old value and assigns a new one (DINO's running centre,
``self.c = 0.9 * self.c + 0.1 * batch_mean``; a centre set from the first batch) keeps state a
graph would freeze at the recording's tensor. Such an attribute is a *state*: the recording's
forward reads it from a slot of its own (static memory made before the capture), each replay
first copies the attribute's tensor into the slot, then assigns the new tensor as above. The
guard keys a state by what the slot holds (shape, strides, dtype, device). An attribute learnt as
assigned and later read without being assigned (a table built on first use, rebuilt for a longer
batch) becomes a state too. A state whose tensor requires grad (a graph across calls) stays a
side effect. A forward that writes the old tensor in place before rebinding it writes the slot
instead: the recording call's verification sees the attribute differ from eager's and runs it
eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["MODULE_SLOTS", "Assignment", "AttributeOutputs", "StepAttributes", "attribute_storages"]
__all__ += ["held_entries"]

_MISSING = object()
#: where a module keeps its parameters, buffers and submodules (not plain attributes)
MODULE_SLOTS = ("_parameters", "_buffers", "_modules")
#: an attribute: its module and name
Target = tuple[Any, Any]  # (a module, a name); or a held dict or plain object, and its key
#: one changing write the probe saw: module, name, the value before the run, the value after
Write = tuple[Any, Any, object, object]
#: a value an attribute may hold before its first tensor (an initial ``None`` or ``0.0``)
_PLAIN = (type(None), bool, int, float)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held(value: object) -> bool:
    """A plain tensor whose memory an op could read (a parameter is the module's, not an attribute's)."""
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, nn.Parameter)
        and value.layout == torch.strided
        and value.device.type != "meta"
        and value.numel() > 0
    )


def attribute_storages(module: nn.Module) -> set[int]:
    """The storages of the tensors the tree's modules hold as plain attributes or buffers, or in a
    dict or plain object one holds (``self.stats["center"]``): an op of the forward that reads one
    reads an attribute's value (the probe notes which)."""
    found = set()
    for m in module.modules():
        for v in (*m.__dict__.values(), *(m.__dict__.get("_buffers") or {}).values()):
            if _held(v):
                found.add(_storage(v))
            elif (entries := held_entries(v)) is not None:
                found.update(_storage(e) for e in entries.values() if _held(e))
    return found


def held_entries(value: object) -> dict | None:
    """A held dict's entries, or a plain object's attributes (not a module's, a tensor's, a
    class's or a callable's): the live dict a forward may set a target in."""
    if isinstance(value, dict):
        return value
    if isinstance(value, (nn.Module, torch.Tensor, type)) or callable(value):
        return None
    attrs = getattr(value, "__dict__", None)
    return attrs if isinstance(attrs, dict) else None


def _state(old: object, new: object, read: Collection[int]) -> bool:
    """A tensor read and replaced by a new one (a running centre): state a slot can carry. Not
    one that requires grad: its graph would link one call's backward to the last's."""
    return (
        _held(old)
        and _held(new)
        and _storage(old) in read
        and not old.requires_grad  # type: ignore[union-attr]
        and not new.requires_grad  # type: ignore[union-attr]
    )


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same layout: what the module guard keys a state by (its slot)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.stride() == b.stride()
    )


def _is_buffer(m: object, name: Any) -> bool:
    return isinstance(m, nn.Module) and name in (m.__dict__.get("_buffers") or {})


def _namespace(m: object, name: Any) -> dict:
    """Where the attribute lives: a module's registered buffer in ``_buffers``, its other attributes
    in ``__dict__``; a held dict's entry in the dict, a plain object's attribute in its ``__dict__``."""
    if isinstance(m, dict):
        return m
    if not isinstance(m, nn.Module):
        return vars(m)
    buffers = m.__dict__.get("_buffers") or {}
    return buffers if name in buffers else m.__dict__


def _settable(m: object, name: Any) -> bool:
    """A plain attribute: not a parameter, buffer or submodule, nor a property of the class (any
    entry of a held dict)."""
    if isinstance(m, dict):
        return True
    if isinstance(m, nn.Module) and any(
        name in (m.__dict__.get(slot) or ()) for slot in MODULE_SLOTS
    ):
        return False
    return not hasattr(type(getattr(type(m), name, None)), "__set__")


class AttributeOutputs:
    """One recorder's attributes its forward assigns without reading them (learnt by the probe),
    and the :class:`Assignment` its new recordings make. ``key_by_kind``: tells the module guard."""

    __slots__ = ("_key_by_kind", "_known", "_module", "_states")

    def __init__(
        self, module: nn.Module, key_by_kind: Callable[[list[Target], bool], None]
    ) -> None:
        self._module = module
        self._key_by_kind = key_by_kind
        self._known: dict[tuple[int, str], Target] = {}
        self._states: set[tuple[int, str]] = set()  # of those, read too: fed into a slot

    def sort(
        self, writes: Iterable[Write], read: Collection[int], foreign: Collection[int]
    ) -> tuple[list[Target], set[tuple[int, str]], str | None]:
        """Of the probe's changing writes, those a recording repeats as outputs, which of those
        are states (read too: ``(id, name)``); and why none can be recorded: an attribute learnt
        as assigned whose tensor requiring grad an op of the forward read (``read``: storages). ``foreign``: storages the recording does not own (parameters,
        buffers, inputs): a write of one of those is no computed output."""
        writes = list(writes)
        names = {id(m): n or type(m).__name__ for n, m in self._module.named_modules()}
        before = {(id(m), name): old for m, name, old, _ in writes}
        states = {
            (id(m), name)
            for m, name, old, new in writes
            if _state(old, new, read) or ((id(m), name) in self._states and _held(new))
        }  # a learnt state's forward reads its slot, not the old tensor
        kept: list[Target] = []  # learnt as assigned, read now and left: a state (a filled cache)
        for key, (m, name) in self._known.items():
            value = before.get(key, _namespace(m, name).get(name))  # as the forward found it
            if _held(value) and _storage(value) in read and key not in states:
                if value.requires_grad:  # type: ignore[union-attr]
                    return (
                        [],
                        set(),
                        (
                            f"forward reads {names.get(id(m), type(m).__name__)}.{name}, a tensor it "
                            "assigns that requires grad: a replay would keep its recording call's graph"
                        ),
                    )
                states.add(key)
                kept += [] if key in before else [(m, name)]
        outputs = [
            (m, name)
            for m, name, old, new in writes
            if (id(m) in names or not isinstance(m, nn.Module))  # a held container's entry
            and (_settable(m, name) or ((id(m), name) in states and _is_buffer(m, name)))
            and _held(new)
            and not new.retains_grad  # type: ignore[union-attr]  # its .grad: no replay fills it
            and _storage(new) not in foreign
            and (
                old is _MISSING
                or isinstance(old, _PLAIN)
                or (_held(old) and _storage(old) not in read)
                or (id(m), name) in states
            )
        ]
        outputs += kept
        return outputs, states & {(id(m), n) for m, n in outputs}, None

    def unknown(
        self, targets: Iterable[Target], states: Collection[tuple[int, str]]
    ) -> list[Target]:
        """The targets not learnt yet, or learnt as written only and now read too (states)."""
        return [
            (m, n)
            for m, n in targets
            if (id(m), n) not in self._known
            or ((id(m), n) in states and (id(m), n) not in self._states)
        ]

    def learn(self, targets: Sequence[Target], states: Collection[tuple[int, str]]) -> None:
        """Record these from now on; the module guard keys them by kind (a state by its slot)."""
        for m, name in targets:
            self._known[(id(m), name)] = (m, name)
        read = [(m, n) for m, n in targets if (id(m), n) in states]
        self._states.update((id(m), n) for m, n in read)
        self._key_by_kind([t for t in targets if t not in read], False)
        self._key_by_kind(read, True)

    def targets(self) -> list[Target]:
        """The attributes learnt so far (a run's writes of them are outputs, not effects)."""
        return list(self._known.values())

    def assignment(self) -> Assignment | None:
        """What a recording made now includes (None: nothing learnt, the forward as it is)."""
        if not self._known:
            return None
        return Assignment(list(self._known.values()), self._states)

    @staticmethod
    def missing() -> object:
        """The value a write's ``old`` has when the attribute did not exist before the run."""
        return _MISSING


class Assignment:
    """One recording's attribute outputs: its forward returns ``(outputs, {i: tensor})`` for
    the targets a run assigned, and a replay assigns those tensors. A state's forward reads its
    slot (``feed`` fills it before a replay; a run outside a capture fills it itself)."""

    __slots__ = ("_slots", "_targets")

    def __init__(self, targets: Sequence[Target], states: Collection[tuple[int, str]] = ()) -> None:
        self._targets = tuple((m, _namespace(m, name), name) for m, name in targets)
        # made and filled now, before any run of the recording call: a slot from a capture's pool
        # could share a temporary's block, and a fill inside a run would be recorded with it
        self._slots = {
            i: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).copy_(v)
            for i, (m, d, name) in enumerate(self._targets)
            if (id(m), name) in states and _held(v := d.get(name))
        }

    def feed(self) -> None:
        """Before a replay (and eager's run beside it): each state's slot holds the attribute's
        tensor as the call found it."""
        for i, slot in self._slots.items():
            _, d, name = self._targets[i]
            slot.copy_(d[name])

    def _bind(self) -> list[tuple[dict, str, object, torch.Tensor]]:
        """The states' slots bound in the attributes' place; what to put back where the forward
        does not assign (a run never writes a slot: the forward rebinds the attribute)."""
        bound = []
        for i, slot in self._slots.items():
            _, d, name = self._targets[i]
            bound.append((d, name, d.get(name), slot))
            d[name] = slot
        return bound

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` returning what it returns and what it assigned to the targets: ``{i: tensor}``,
        or for a tensor that is one of its outputs (``self.last = out; return out``) or one
        assigned to an earlier target, where that one is (``"output j"``, ``"attribute k"``), so a
        replay hands out one tensor object where eager had one."""
        targets = self._targets

        def run(*args: Any, **kwargs: Any) -> tuple[Any, dict[int, torch.Tensor | str]]:
            before = [d.get(name, _MISSING) for _, d, name in targets]
            bound = self._bind()
            try:
                out = fn(*args, **kwargs)
            finally:
                for d, name, value, slot in bound:
                    if d.get(name) is slot:
                        d[name] = value  # not assigned this time: the attribute as it was
            seen = {id(t): f"output {j}" for j, t in enumerate(tree_leaves(out))}
            written: dict[int, torch.Tensor | str] = {}
            for i, ((_, d, name), old) in enumerate(zip(targets, before, strict=True)):
                new = d.get(name, _MISSING)
                if new is not old and isinstance(new, torch.Tensor):
                    ref = seen.get(id(new))
                    written[i] = new if ref is None else ref
                    if ref is None:
                        seen[id(new)] = f"attribute {i}"
            return out, written

        return run

    def hand_out(self, out: Any, written: dict[int, torch.Tensor | str], bind: bool = True) -> None:
        """After a whole step's replay: copies of the assigned tensors bound, as :meth:`assign`
        binds (the step hands back no static memory: the next replay overwrites it)."""
        copies = {i: t.clone() if isinstance(t, torch.Tensor) else t for i, t in written.items()}
        self.assign((out, copies), bind)

    def assign(self, result: tuple[Any, dict[int, torch.Tensor | str]], bind: bool = True) -> Any:
        """The forward's own outputs; with ``bind``, the replayed tensors assigned as eager's
        forward assigns them. A tensor replacing a tensor of its layout is a plain dict write (the
        guard keys a state by shape, strides, dtype and device, the rest only as a tensor); one
        replacing anything else goes through ``setattr``, which the guard sees: a state of another
        shape (a batch of another size) keys the next call anew."""
        out, written = result
        if bind:
            targets = self._targets
            for i, t in written.items():
                if isinstance(t, str):  # the same tensor as an output, or as another attribute
                    kind, _, j = t.partition(" ")
                    t = tree_leaves(out)[int(j)] if kind == "output" else written[int(j)]
                m, d, name = targets[i]
                old = d.get(name)
                if not isinstance(m, nn.Module) or (
                    isinstance(old, torch.Tensor) and _alike(old, t)
                ):
                    d[name] = t  # a buffer's stays in _buffers; a held container's entry
                else:
                    setattr(m, name, t)
        return out


class StepAttributes:
    """A whole step's attribute outputs (``rk.TrainStep``): learnt from its recording call's run
    (the writes :class:`~replaykit.verify.side_effects.SideEffects` saw, the old tensors its ops
    read), returned by the captured body beside the loss, bound as copies after each replay
    (:meth:`Assignment.hand_out`: the whole step has no autograd output to hand back)."""

    __slots__ = ("_model", "outputs")

    def __init__(self, model: nn.Module, key_by_kind: Callable[[list[Target], bool], None]) -> None:
        self._model = model
        self.outputs = AttributeOutputs(model, key_by_kind)

    def watched(self) -> set[int]:
        """The storages whose reads a run is watched for (none: nothing to learn)."""
        return attribute_storages(self._model)

    def learn(
        self, writes: Iterable[Write], read: Collection[int], own: Iterable[torch.Tensor]
    ) -> tuple[list[Target], str | None, list[Target]]:
        """Of a run's changing writes: the outputs (no longer effects), why none can be recorded
        (a retirement), and those learnt now (that run stands as the call; the next records
        them). ``own``: parameters, buffers and inputs, whose storages are no computed output."""
        foreign = {t.untyped_storage().data_ptr() for t in own if t.layout == torch.strided}
        outputs, states, why = self.outputs.sort(writes, read, foreign)
        if why is not None:
            return [], why, []
        new = self.outputs.unknown(outputs, states)
        if new:
            self.outputs.learn(new, states)
        return outputs, None, new

    def values(self) -> list[tuple[str, torch.Tensor]]:
        """The learnt attributes' tensors, named for the recording's check against eager."""
        out = []
        for m, name in self.outputs.targets():
            value = m.get(name) if isinstance(m, dict) else getattr(m, name, None)
            if isinstance(value, torch.Tensor):
                out.append((f"attribute {type(m).__name__}.{name}", value))
        return out

    @staticmethod
    def body(
        assignment: Assignment, fn: Callable[..., list[torch.Tensor]], *args: Any
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor | str]]:
        """``fn``'s outputs and the tensors it assigned after them (what the capture returns), and
        what it assigned by target (what each replay binds)."""
        out, written = assignment.wrap(fn)(*args)
        return [*out, *(t for t in written.values() if isinstance(t, torch.Tensor))], written
