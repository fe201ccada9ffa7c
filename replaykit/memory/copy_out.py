"""Copy-out of live aliases: tensors the caller holds that share a recording's static memory.

A replayed backward returns static gradient buffers, and AccumulateGrad adopts such a
buffer as ``.grad`` when ``.grad`` was None; a replayed forward returns static outputs.
Whoever still holds one of them at the next replay would see it overwritten (on CUDA,
by any replay in the recorder's shared pool). So before every replay each static
storage must be referenced by its recording alone:

- an output is handed out on a storage object of its own that points at the static memory
  without owning it (:class:`Handout`), so every tensor made from it — the output, its
  ``.detach()`` kept in a list, a view, a tensor autograd saved — shares that one storage
  object. One still held at the next replay is moved, with all its holders at once, to
  memory of its own holding the same values (its data pointer swapped with a copy's):
  ``preds.append(logits.detach())`` keeps its values and the call replays. The recording
  hands out a fresh storage object from then on. A torch without that swap (before 2.12: the
  H200's 2.11, Colab's) cannot move a holder, so each replay hands out a copy of its static
  outputs instead (one device copy per static storage, memory eager would allocate too): a
  kept output is the caller's own, and the call replays;
- a gradient buffer the recorder can reach (a parameter's ``.grad``) gets storage of its
  own: same values, same tensor, so every holder of that tensor keeps its values. This
  happens at forward time, before the replay; inside the replayed backward is too late;
- without the swap, a gradient buffer that is ``.grad`` and is also held through a view or
  ``.data`` cannot move: it is *given away* instead (:meth:`StaticAliases.given_away`): the
  buffer stays ``.grad``, the caller's for good, and the entry point drops every recording that
  could write its memory and records anew (journal ``rerecord``, ``grads_given_away``). Once
  ``.grad`` exists AccumulateGrad adds into it in place and never adopts a buffer again, so the
  later calls replay;
- an alias it cannot reach or give away (a gradient kept by a callback after
  ``zero_grad(set_to_none=True)``, an output sharing a parameter's or an input's storage)
  makes the call route eager (reason ``live_alias``), which leaves static memory alone,
  until that holder lets go.

Liveness is read from storage use counts (C-level, no references held), so a recording
whose aliases all died costs one comparison. A handed-out storage does not keep the static
memory alive: whatever frees a recording copies out first, and a recording collected with
its outputs still held moves them from a finalizer, before its static memory goes.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections.abc import Iterable, Sequence

import torch

_use_count = torch._C._storage_Use_Count
#: both are torch's own (inductor's CUDA graph trees and FSDP use them); without them outputs
#: are handed out as the static tensors themselves and a held view routes eager
_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
_alias_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)


def holders_move() -> bool:
    """Whether this torch can move every holder of a handed-out storage (else: copies are handed out)."""
    return _swap is not None and _alias_storage is not None


def _cdata(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


#: the static tensors behind live hand-outs, by their memory's address (held weakly: an entry
#: goes with its static tensor, so an address found here is that tensor's memory): a recording of
#: another entry point that reads a handed-out tensor (a shared parameter's ``.grad``) reads the
#: static memory, not the hand-out, which its owner's copy-out may move away
_STATICS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class Handout:
    """What a recording's replays hand out: views of its static outputs on storage objects of
    their own (one per static storage, not owning its memory), and their use-count baselines.

    ``foreign`` storages (an input's, a parameter's, a buffer's: memory the recording does not
    own) are handed out as they are, reached through the outputs themselves as before. Without
    :func:`holders_move`, each hand-out is a copy per static storage.
    """

    __slots__ = (
        "__weakref__",
        "_copied",
        "_whole",
        "baseline",
        "cdatas",
        "groups",
        "statics",
        "tensors",
    )

    def __init__(self, statics: Sequence[torch.Tensor], foreign: Iterable[torch.Tensor]) -> None:
        self.statics = list(
            statics
        )  # owning: the memory stays while a handed-out view may point at it
        theirs = {t.untyped_storage().data_ptr() for t in foreign}
        by_ptr: dict[int, list[int]] = {}  # outputs sharing one static storage share one handed out
        for i, t in enumerate(self.statics):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in theirs:
                by_ptr.setdefault(ptr, []).append(i)
        moves = holders_move()
        self.groups = list(by_ptr.values()) if moves else []
        self.tensors = list(self.statics)
        for group in self.groups:
            self._fresh(group)
        self.cdatas = [_cdata(t) for t in self.tensors]
        self.baseline = list(map(_use_count, self.cdatas))
        self._copied = [] if moves else list(by_ptr.values())
        # one contiguous static tensor spanning its storage: empty_like makes its twin
        self._whole = {g[0] for g in self.groups if len(g) == 1 and _spans(self.statics[g[0]])}

    def hand_out(self) -> list[torch.Tensor]:
        """What a replay returns: the handed-out views, or (``copies``) a copy of each static
        storage with its outputs' views on it, so outputs that shared memory still share it."""
        if not self._copied:
            return self.tensors
        out = list(self.tensors)
        for group in self._copied:
            own = self.statics[group[0]].untyped_storage().clone()
            for i in group:
                t = self.statics[i]
                view = torch.empty(0, dtype=t.dtype, device=t.device)
                out[i] = view.set_(own, t.storage_offset(), t.size(), t.stride())
        return out

    def _fresh(self, group: list[int]) -> None:
        """New handed-out views for one static storage (nobody holds them yet)."""
        storage = self.statics[group[0]].untyped_storage()
        _STATICS[storage.data_ptr()] = self.statics[group[0]]
        own = _alias_storage(storage.data_ptr(), storage.device, storage.nbytes())
        for i in group:
            t = self.statics[i]
            view = torch.empty(0, dtype=t.dtype, device=t.device)
            self.tensors[i] = view.set_(own, t.storage_offset(), t.size(), t.stride())

    def move_held(self) -> int:
        """Give each held handed-out storage memory of its own with the same values (every holder
        moves with it); returns how many moved. The recording hands out fresh ones after."""
        held = [g for g in self.groups if _use_count(self.cdatas[g[0]]) != self.baseline[g[0]]]
        if not held:
            return 0
        storages = [self.tensors[g[0]].untyped_storage() for g in held]
        # a static tensor that is its whole storage is copied as itself, and its copy is handed
        # out next (after the swap it views the static memory); any other storage, as bytes
        whole = [g[0] in self._whole for g in held]
        src = [
            self.statics[g[0]] if w else torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
            for g, w, s in zip(held, whole, storages, strict=True)
        ]
        dst = list(map(torch.empty_like, src))
        with torch.no_grad():
            torch._foreach_copy_(dst, src)  # one launch per dtype and device, not one per storage
        for held_storage, copy in zip(storages, dst, strict=True):
            held_storage._swap_data_ptr_(
                copy.untyped_storage()
            )  # the holders' storage owns the copy
        del storages, src, held_storage  # each copy's storage now views the static memory
        for group, w, copy in zip(held, whole, dst, strict=True):
            if w:
                self.tensors[group[0]] = copy
            else:
                self._fresh(group)
            # a tensor's storage is counted once, however many Python names hold the tensor
            for j in group:
                self.cdatas[j] = _cdata(self.tensors[j])
                self.baseline[j] = _use_count(self.cdatas[j])
        return len(held)

    def owned(self, i: int) -> bool:
        return self.tensors[i] is not self.statics[i]


def _spans(t: torch.Tensor) -> bool:
    """Contiguous from its storage's start to its end."""
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _own_memory(tensors: list[torch.Tensor]) -> int:
    """Give each tensor memory of its own with the same values (``t.data = copy``: holders by name
    follow, a view or ``.data`` of it does not); one copy launch per dtype and device."""
    if tensors:
        with torch.no_grad():
            fresh = [torch.empty_like(t) for t in tensors]
            torch._foreach_copy_(fresh, tensors)
            for t, f in zip(tensors, fresh, strict=True):
                t.data = f
    return len(tensors)


#: hand-outs whose recording was collected while a capture ran on this thread: moved at the
#: next entry point's call (:func:`settle`)
_DEFERRED: list[Handout] = []


def _capturing() -> bool:
    """A capture under way on this thread: a CUDA graph's (its stream is the current one) or the
    tape's (a dispatch mode). A collected recording's copies made now would be recorded into it."""
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _release(handout: Handout) -> None:
    """A recording's aliases collected: held outputs move to memory of their own first (later,
    where the garbage collector ran this inside a capture)."""
    if _capturing():
        _DEFERRED.append(handout)
    else:
        handout.move_held()


def settle() -> None:
    """The moves a capture put off (see :func:`_release`): done before a call's route."""
    while _DEFERRED:
        _DEFERRED.pop().move_held()


class GradHandout:
    """One recording's static gradient buffers and what its replayed backward hands out for them.

    Eager's ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place and the next backward
    accumulates into it, so a reference, a view or the ``.data`` of ``.grad`` the caller (or an
    optimizer) keeps *is* the next gradient. With the storage swap, each buffer is handed out as a
    view on a storage object of its own (a :class:`Handout`; the recording's backward detaches
    these, :attr:`handed`, in place of its buffers); AccumulateGrad adopts one as ``.grad`` when
    ``.grad`` was None, and one still held at the next replay moves to memory of its own with every
    holder of that storage: they keep aliasing ``.grad``, and the replay accumulates into it in
    place, as eager does. Without the swap the buffers are handed out themselves: a held ``.grad``
    moves alone (``t.data = copy``) only where nothing else holds its storage; otherwise it stays
    in place, where eager's backward accumulates: given away (:meth:`held_as_grad`) or, where it
    is not ``.grad`` any more, the call runs eagerly (``live_alias``).
    """

    __slots__ = ("baseline", "cdatas", "handed", "handout", "pairs", "slots")

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, static buffer)
        self.slots: list[int] = []  # each buffer's place among the recording's gradients
        self.cdatas: list[int] = []
        self.baseline: list[int] = []
        self.handout: Handout | None = None  # with the swap: what is handed out
        # with the swap: one per gradient the recording returns, the handed-out views in the
        # buffers' places (the recording's backward reads this list; kept up to date in place)
        self.handed: list[torch.Tensor | None] | None = None

    def add(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slots: Sequence[int],
        targets: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor | None] | None:
        """Guard buffers captured later (before any of them is handed out): ``pairs`` (parameter,
        buffer) at ``slots`` among ``targets``, every gradient the recording returns. Returns
        :attr:`handed` (None: the buffers are handed out themselves)."""
        self.pairs += pairs
        self.slots += slots
        cdatas = [_cdata(buf) for _, buf in pairs]
        self.cdatas += cdatas
        self.baseline += list(map(_use_count, cdatas))
        if pairs and holders_move():
            self.handout = Handout([buf for _, buf in self.pairs], ())
            self.handed = list(targets)
            self._sync()
        return self.handed

    def _sync(self) -> None:
        handed, handout = self.handed, self.handout
        assert handed is not None and handout is not None
        for slot, t in zip(self.slots, handout.tensors, strict=True):
            handed[slot] = t

    def clear(self) -> bool:
        """Nothing outside the recording holds a buffer (use counts at baseline)."""
        handout = self.handout
        if handout is not None:
            return list(map(_use_count, handout.cdatas)) == handout.baseline
        return list(map(_use_count, self.cdatas)) == self.baseline

    def copy_out(self) -> int:
        """Move held gradients to memory of their own (see the class); returns how many moved."""
        if self.handout is not None:
            moved = self.handout.move_held()
            if moved:
                self._sync()  # fresh views are handed out from now on
            return moved
        return _own_memory(self._alone())

    def held_as_grad(self) -> int:
        """Without the swap, after copy-out: how many buffers are still held, where every one is
        its parameter's ``.grad`` (a view or ``.data`` of it holds it too); 0 when none is held or
        one is not ``.grad`` (kept after ``zero_grad(set_to_none=True)``: the next backward would
        adopt a buffer again, and giving it away would never end)."""
        if self.handout is not None:
            return 0
        held = {c for c, b in zip(self.cdatas, self.baseline, strict=True) if _use_count(c) != b}
        grads = {_cdata(g) for p, _ in self.pairs if (g := p.grad) is not None}
        return len(held) if held <= grads else 0

    def _alone(self) -> list[torch.Tensor]:
        """Without the swap: the ``.grad`` tensors on a buffer whose storage nothing else holds
        (a view or ``.data`` of one could not follow it)."""
        on: dict[int, dict[int, torch.Tensor]] = {}
        base = dict(zip(self.cdatas, self.baseline, strict=True))
        for param, buf in self.pairs:
            g = param.grad
            if g is not None and g.data_ptr() == buf.data_ptr() and (c := _cdata(g)) in base:
                on.setdefault(c, {})[id(g)] = g
        return [
            g
            for c, grads in on.items()
            if _use_count(c) - base[c] == len(grads)
            for g in grads.values()
        ]


class StaticAliases:
    """The static storages one recording hands out, and how to reach their holders. Outputs and
    gradient buffers are handed out by different halves of a replay (its forward, its replayed
    backward), so each half's use counts are read only after it handed something out: a backward run
    exactly through the recorded graph (partial, ``multi_backward``) or a forward whose graph was
    dropped leaves the other half alone."""

    __slots__ = (
        "__weakref__",
        "_grads",
        "_grads_out",
        "_handout",
        "_outputs_out",
        "_refs",
        "dirty",
        "outputs",
    )

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        foreign: Iterable[torch.Tensor] = (),
    ) -> None:
        """``outputs``: static outputs to guard; ``foreign``: tensors whose storage the recording
        does not own (inputs, parameters). Gradient buffers join with :meth:`add_grads`."""
        self._handout = Handout(outputs, foreign)
        if self._handout.groups:  # collected with outputs still held: they move first
            weakref.finalize(self, _release, self._handout).atexit = False
        self._grads = GradHandout()
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self._outputs_out = self._grads_out = (
            False  # handed out since their use counts were last at baseline
        )
        self.dirty = False

    def add_grads(
        self,
        grads: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slots: Sequence[int],
        targets: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor | None] | None:
        """Guard static gradient buffers captured later (before any of them is handed out); returns
        what the recording's backward hands out in their places (:class:`GradHandout`)."""
        had = self._grads.handout
        handed = self._grads.add(grads, slots, targets)
        handout = self._grads.handout
        if handout is not None and handout is not had:  # collected with gradients held: they move
            weakref.finalize(self, _release, handout).atexit = False
        return handed

    def hand_out(self) -> list[torch.Tensor]:
        """What a replay returns, one per static output (none: the static outputs themselves)."""
        return self._handout.hand_out()

    def handed_out(self, outputs: Sequence[torch.Tensor]) -> None:
        """A replayed forward returned ``outputs`` (kept weakly, to reach them)."""
        handout = self._handout
        if len(handout.groups) < len(handout.tensors):  # a foreign one: reached through the output
            self._refs = [weakref.ref(o) for o in outputs]
        self._outputs_out = self.dirty = True

    def handed_out_grads(self) -> None:
        """A replayed backward returned the gradient buffers (reached later via ``.grad``)."""
        self._grads_out = self.dirty = True

    def _settle(self) -> bool:
        """Clear each half whose use counts are back at baseline; True when nothing is aliased."""
        handout = self._handout
        if self._outputs_out and list(map(_use_count, handout.cdatas)) == handout.baseline:
            self._outputs_out, self._refs = False, []
        if self._grads_out and self._grads.clear():
            self._grads_out = False
        self.dirty = self._outputs_out or self._grads_out
        return not self.dirty

    def given_away(self) -> int:
        """After a :meth:`copy_out` that left aliases: how many held gradient buffers can be given
        to the caller (each is ``.grad``: :meth:`GradHandout.held_as_grad`); 0 when an alias is
        left that cannot (an output, a buffer that is not ``.grad``). The caller then drops every
        recording that could write their memory."""
        return 0 if self._outputs_out else self._grads.held_as_grad()

    def copy_out(self) -> tuple[int, bool]:
        """Give held aliases their own storage; returns (copied, whether none is left)."""
        if not self.dirty or self._settle():
            return 0, True
        handout = self._handout
        moved = handout.move_held() if self._outputs_out else 0
        moved += self._grads.copy_out() if self._grads_out else 0
        cdatas = {c for i, c in enumerate(handout.cdatas) if not handout.owned(i)}
        cdatas.update(self._grads.cdatas)
        live = [t for ref in self._refs if (t := ref()) is not None and _cdata(t) in cdatas]
        moved += _own_memory(live)
        self._refs = []
        self._outputs_out = self._grads_out = True  # read both halves again
        return moved, self._settle()


def _release_all(handouts: dict[tuple[int, int], Handout]) -> None:
    """A whole step's hand-outs collected: held gradients move to memory of their own first."""
    for handout in handouts.values():
        _release(handout)


def _on_static(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached; where it is a hand-out of another recording's static memory, a view of
    that memory on the static tensor's own storage (which no copy-out moves)."""
    storage = t.untyped_storage()
    static = _STATICS.get(storage.data_ptr())
    if static is None or static.untyped_storage()._cdata == storage._cdata:
        return t.detach()
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(static.untyped_storage(), t.storage_offset(), t.size(), t.stride())


class StepGrads:
    """The gradients a whole step hands out between micro-batches, and their copy-out before a
    first phase overwrites the static buffers.

    Eager's ``.grad`` between micro-batches is one tensor holding the running sum, accumulated
    into in place; the next step's first micro-batch makes new gradients and leaves the old ones
    with their holders. So a parameter keeps the ``.grad`` handed out to it through the
    micro-batches, and at a first phase a held one gets memory of its own. With the storage swap
    each buffer is handed out on a storage object of its own (a :class:`Handout`) and moves with
    every holder (a view, ``.data``, a list of them); without it the buffer's own alias is handed
    out and moves alone when held by name (``t.data = copy``): a holder that cannot reach keeps the
    step's call eager (``live_alias``)."""

    __slots__ = ("__weakref__", "_handed", "_handouts", "_ids", "baseline", "storages")

    def __init__(self) -> None:
        self._handouts: dict[tuple[int, int], Handout] = {}  # by static storage and offset
        self._handed: list[torch.Tensor] = []  # without the swap: aliases handed out since copy-out
        self._ids: set[int] = set()  # theirs (alive while listed)
        # the static gradient storages handed out, and their use counts with no holder but the
        # recordings (a recording call adds holders of its own: ``rebase``)
        self.storages: list[int] = []
        self.baseline: list[int] = []
        weakref.finalize(self, _release_all, self._handouts).atexit = False

    def track(self, g: torch.Tensor) -> None:
        """A static gradient storage about to be handed out for the first time (at its recording
        call: nobody but the recordings holds it yet): its use count then is its baseline."""
        cdata = _cdata(g)
        if cdata not in self.storages:
            self.storages.append(cdata)
            self.baseline.append(_use_count(cdata))

    def counts(self) -> list[int]:
        """The tracked storages' use counts now."""
        return list(map(_use_count, self.storages))

    def rebase(self, before: Sequence[int]) -> None:
        """A recording call made holders of its own since ``before`` (:meth:`counts`): they count
        as the recordings'."""
        self.baseline = [
            b + n - c for b, n, c in zip(self.baseline, self.counts(), before, strict=True)
        ]

    def live_alias(self) -> bool:
        """After copy-out: whether something else still shares a static gradient storage (a view,
        ``.detach()`` or ``.data`` of a handed-out gradient, which copy-out cannot reach)."""
        return any(map(operator.gt, map(_use_count, self.storages), self.baseline))

    def untrack(self) -> None:
        """The recordings were dropped: no storage is theirs any more."""
        self.storages, self.baseline = [], []

    def handouts(self, grads: Sequence[torch.Tensor | None]) -> list[Handout | None]:
        """One recording's: per gradient buffer the hand-out it shares with the other phases'
        recordings of that buffer (None: none, or a torch without the swap)."""
        if not holders_move():
            return [None] * len(grads)
        out: list[Handout | None] = []
        for g in grads:
            if g is None:
                out.append(None)
                continue
            key = (_cdata(g), g.storage_offset())
            if key not in self._handouts:
                self._handouts[key] = Handout([g], ())
            out.append(self._handouts[key])
        return out

    def hand_out(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        handouts: Sequence[Handout | None],
    ) -> None:
        """``.grad`` as eager leaves it between micro-batches; one already on a buffer stays."""
        for p, g, h in zip(params, grads, handouts, strict=True):
            if g is None:
                p.grad = None
                continue
            cur = p.grad
            if h is not None:
                if cur is None or _cdata(cur) != h.cdatas[0]:
                    p.grad = h.tensors[0].detach()
            elif cur is None or id(cur) not in self._ids:
                alias = g.detach()
                p.grad = alias
                self._handed.append(alias)
                self._ids.add(id(alias))

    def private(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """What a recording reads for the incoming gradients: aliases of their memory, never on a
        handed-out storage, which a later copy-out moves with its holders (this step's, or another
        entry point's whose parameters this model shares): :func:`_on_static`."""
        return [None if g is None else _on_static(g) for g in grads]

    def copy_out(self) -> int:
        """Before a first phase: held gradients get memory of their own; returns how many."""
        moved = sum(
            h.move_held()
            for h in self._handouts.values()
            if _use_count(h.cdatas[0]) != h.baseline[0]
        )
        handed, self._handed = self._handed, []
        self._ids = set()
        held = [a for a in handed if sys.getrefcount(a) > 3]  # the list, the loop, the argument
        return moved + _own_memory(held)

    def drop(self) -> None:
        """The recordings go: held gradients move first, then the hand-outs are forgotten."""
        _release_all(self._handouts)
        self._handouts.clear()
        self._handed, self._ids = [], set()
