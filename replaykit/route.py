"""The one route every entry point takes, and what the entry points share.

The questions every call is asked are written here once, so no entry point skips one or asks
them in another order (DESIGN.md, "One route, three entry points"): :meth:`Entry.admit`, the
entry's key, then :meth:`Entry.choose`. The entry points differ only in their two hooks
(:meth:`Entry.early_checks`, :meth:`Entry.late_checks`). :class:`Lifecycle` holds the policy the
route reads: the owner thread, the journal, the gate, re-record (bounded by ``max_rerecords``),
retirement (one :class:`ReplayWarning`; ``strict=True`` raises) and release (not a retirement).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from .errors import ReplayError, ReplayWarning
from .guards.module import ModuleGuard
from .guards.storage import ModuleWatch
from .guards.switches import key as switches_key
from .journal import KINDS, Journal
from .memory.copy_out import settle
from .memory.pool import MemoryPool
from .protections import Switches

_get_ident = threading.get_ident
_grad_enabled = torch.is_grad_enabled
_anomaly = torch.is_anomaly_enabled
_functorch = torch._C._are_functorch_transforms_active
_graph_task = torch._C._current_graph_task_id
_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_hooks_message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_hooks_disable = torch._C._autograd._saved_tensors_hooks_disable
_hooks_enable = torch._C._autograd._saved_tensors_hooks_enable


def _saved_hooks_pushed() -> bool:
    """Whether saved-tensor default hooks are pushed, where torch has no getter for them (2.4):
    disabling the hooks raises while any are pushed and changes nothing else; the disabled state
    is put back as it was. Never calls a hook (a user's pack hook may count or offload)."""
    before = _hooks_message()
    try:
        _hooks_disable(before if before is not None else "replaykit: probing saved-tensor hooks")
    except RuntimeError:
        return True
    finally:
        if before is None:
            _hooks_enable()
    return False


#: What to change when most calls run eagerly for a reason (the one-time warning names it).
HINTS = {
    "budget": (
        "every call needed a recording of its own until max_recordings was spent: a host value changes every call "
        "(a float lr set by a scheduler: give the optimizer a tensor lr, lr=torch.tensor(...), with fused=True or "
        "capturable=True; a float attribute the forward reads) or batch shapes vary (pad to a few lengths)"
    ),
    "diverged": "the recording computes differently from eager (the journal's refuse event names the tensor)",
    "hooks": "hooks run Python a replay skips: remove them while replaying, or keep them and train eagerly",
    "object_argument": "an object argument could change under a recording: pass tensors and plain values",
    "input_requires_grad": "an input that requires grad gets no .grad from a replay: detach it, or train eagerly",
    "pool_busy": (
        "another entry point sharing its MemoryPool held live memory there (a pending backward, an accumulation "
        "under way): finish one's step before the other's, or give each its own pool"
    ),
}
#: What a new recording's key differs in from every one held (its first part that differs), as
#: ``summary()`` tallies it: a host value that changes every call records every call, then "budget".
NEW_PARTS = {
    "phase": "the step's phase (an accumulation micro-batch or the last)",
    "state": "the module tree's state (train/eval, hooks, a host attribute of a module)",
    "requires_grad": "which parameters require grad",
    "incoming_grads": "the gradients the call starts from (None or which tensors)",
    "host_values": "the optimizer's, scaler's or clipping's host values",
    "loss_reads": "a value loss_fn reads beside its arguments (a global, closure or held object)",
    "forward_reads": "a value the forward reads beside its arguments (a global, closure or held object)",
    "foreign_leaves": "the leaves outside the model that get gradients",
    "arguments": "the arguments' structure",
    "shapes": "an input's shape, dtype, device or layout",
    "aliasing": "which inputs share memory",
    "argument_values": "a non-tensor argument's value",
    "autocast": "autocast's state",
    "host_reads": "a value read on the host from the inputs, or a host draw that chooses",
}
#: Calls before the share of eager calls is judged, and the share that warns.
_WARN_AFTER, _WARN_SHARE = 20, 0.5


class Watch(Protocol):
    """Something a recording depends on that no write notification reports, compared per call."""

    def reason(self) -> str | None: ...

    def rebaseline(self) -> None: ...


class Lifecycle:
    """One entry point's owner thread, journal, gate, re-record budget and retirement."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        strict: bool,
        on: Switches,
        max_rerecords: int,
        drop: Callable[[], None],
    ) -> None:
        self.name = name
        self.strict = strict
        self.on = on
        self.max_rerecords = max_rerecords
        self.journal = Journal()
        self.retired = False
        self.retire_reason: str | None = None
        self.released = False
        self.rerecords = 0
        self.guard = ModuleGuard(module)
        self.watch = ModuleWatch(module)
        self._drop = drop  # the entry point frees its recordings (now, or after a pending backward)
        self._watches: list[Watch] = []
        self.owner: int | None = None  # the owning thread's ident, once one called
        self._warned_share = False
        #: new recordings by the part of their key no earlier one shared (:data:`NEW_PARTS`)
        self.recorded_for: Counter[str] = Counter()
        #: re-records by their cause's name (before any ``:``)
        self.rerecorded_for: Counter[str] = Counter()
        #: held while recording and by other threads' eager calls: they wait for a recording under way
        self.lock = threading.RLock()
        for protection in sorted(on.off):
            self.journal.add("unsafe", 0, protection)

    # ----------------------------------------------------------------- read-outs
    @property
    def counts(self) -> dict[str, int]:
        """Events by kind (every kind of :data:`replaykit.journal.KINDS`), exact however long the run."""
        counts = self.journal.counts
        return {k: counts.get(k, 0) for k in KINDS}

    @property
    def eager_reasons(self) -> Counter[str]:
        return Counter(self.journal.eager_reasons)

    def summary(self) -> str:
        """One line: the counts that happened and the eager reasons, most frequent first."""
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items() if v and k != "unsafe")
        reasons = "; ".join(f"{r} x{n}" for r, n in self.eager_reasons.most_common())
        new = "; ".join(f"{r} x{n}" for r, n in self.recorded_for.most_common())
        again = "; ".join(f"{r} x{n}" for r, n in self.rerecorded_for.most_common())
        state = (
            f"retired: {self.retire_reason}"
            if self.retired
            else "released"
            if self.released
            else "live"
        )
        return (
            f"{self.name}: {counts or 'no calls'}"
            + (f" | eager: {reasons}" if reasons else "")
            + (f" | recorded anew for: {new}" if new else "")
            + (f" | re-recorded for: {again}" if again else "")
            + f" | {state}"
        )

    # ----------------------------------------------------------------- the routes
    def stopped(self) -> str | None:
        """``retired`` or ``released`` when no call may replay any more."""
        return "retired" if self.retired else "released" if self.released else None

    def owns_thread(self) -> bool:
        """The first thread to call owns the entry point; a call from any other runs eagerly."""
        me = threading.get_ident()
        if self.owner == me:
            return True
        with self.lock:  # two threads' first calls at once: one owner
            if self.owner is None:
                self.owner = me
        return self.owner == me

    def mode(self) -> str | None:
        """Why autograd's mode forbids a replay now, or None (five C-level reads). A replay hands
        autograd fixed kernels' results: under ``no_grad`` there is nothing to record; anomaly mode
        checks each backward op for NaNs (a replayed backward runs none); saved-tensor hooks
        (activation offload, non-reentrant checkpoint) would never see the recording's saved
        tensors; a ``torch.func`` transform wraps the tensors; and a call inside a backward
        (checkpoint's recompute) must not record, nor replay over a pending backward."""
        if not _grad_enabled():
            return "no_grad"
        if self.on.autograd_modes:
            if _anomaly():
                return "anomaly_mode"
            if _graph_task() != -1:
                return "in_backward"
            if _functorch():
                return "functorch"
            if _saved_hooks(False) is not None if _saved_hooks else _saved_hooks_pushed():
                return "saved_tensors_hooks"
        return None

    def eager(self, call: int, reason: str) -> None:
        """Journal an eager route; under ``strict`` anything but a warm-up raises instead."""
        if self.strict and reason != "warmup":
            why = (
                f"{self.name} is retired ({self.retire_reason})"
                if reason == "retired"
                else f"call {call} would run eagerly: {reason}"
            )
            raise ReplayError(f"replaykit: {why}")
        self.journal.add("eager", call, reason)
        if not self._warned_share and call >= _WARN_AFTER:
            self._warn_share(call)

    def _warn_share(self, call: int) -> None:
        """Once: most calls ran eagerly (warm-up aside) — say why and what to change."""
        reasons = self.journal.reasons["eager"]
        eager = sum(reasons.values()) - reasons.get("warmup", 0)
        if eager <= _WARN_SHARE * call or self.retired or self.released:
            return
        self._warned_share = True
        top = next(r for r, _ in reasons.most_common() if r != "warmup")
        hint = HINTS.get(top, "see the journal (summary()) for each call's route")
        if top == "budget" and self.recorded_for:
            part = self.recorded_for.most_common(1)[0][0]
            hint += f"; here the recordings differed in {NEW_PARTS[part]}"
        warnings.warn(
            f"replaykit: {self.name}: {eager} of {call} calls ran eagerly, most for {top!r}: {hint}",
            ReplayWarning,
            stacklevel=4,
        )

    def add_watch(self, watch: Watch) -> None:
        """Compare ``watch`` per call while recordings exist."""
        self._watches.append(watch)

    def gate(self, call: int, recorded: bool) -> tuple[Any, str | None]:
        """Before a call picks a recording: ``(state key, None)``, or ``(None, eager reason)``.
        ``recorded``: whether recordings exist. A change they cannot survive drops them (re-record)
        or retires; with none, a changed tree is simply the new baseline."""
        verdict = self.guard.verdict()
        if recorded:
            change = self._change(verdict.retire)
            if change is not None:
                self.rerecord(change, call)
                if self.retired:
                    return None, "retired"
                recorded = False
        if not recorded and verdict.retire is not None:
            self.guard.rebaseline()
            verdict = self.guard.verdict()
        if verdict.eager is not None and self.on.param_identity:
            return None, verdict.eager
        # the module's host values (protection module_state) and the process-wide kernel switches
        # (protection switches; a flipped one selects another recording) are the state key
        module = verdict.key if self.on.module_state else None
        return ((module, switches_key()) if self.on.switches else module), None

    def _change(self, identity: str | None) -> str | None:
        if self.on.param_identity:
            change = identity or self.watch.reason()
            if change is not None:
                return change
        for watch in self._watches:
            change = watch.reason()
            if change is not None:
                return change
        return None

    def first_record(self) -> None:
        """Called before the first recording (again after a re-record): what exists now is the baseline."""
        self.watch.rebaseline()
        for watch in self._watches:
            watch.rebaseline()

    # ----------------------------------------------------------------- re-record, retire, release
    def rerecord(self, cause: str, call: int, detail: str | None = None) -> None:
        """Drop every recording for a well-defined change; the next call records anew (or retire: budget spent)."""
        if self.rerecords >= self.max_rerecords:
            self.retire(f"{cause} (re-record budget of {self.max_rerecords} spent)", call)
            return
        self.rerecords += 1
        self.rerecorded_for[cause.split(":", 1)[0]] += 1
        self.journal.add("rerecord", call, cause, detail)
        self._drop()

    def retire(
        self, reason: str, call: int, cause: BaseException | None = None, user: bool = False
    ) -> None:
        """Permanent eager: graphs freed, one warning (``strict``: raise instead, unless the user asked)."""
        if self.retired:
            return
        if self.strict and not user:
            raise ReplayError(f"replaykit: {self.name} would retire: {reason}") from cause
        self.retired = True
        self.retire_reason = reason
        self.journal.add("retire", call, reason)
        warnings.warn(
            f"replaykit: {self.name} retired to eager: {reason}", ReplayWarning, stacklevel=5
        )
        self._close()
        self._drop()

    def release(self, call: int) -> bool:
        """Stop for good without retiring; False when released already."""
        if self.released:
            return False
        self.released = True
        self._close()
        self._drop()
        self.journal.add("release", call)
        return True

    def _close(self) -> None:
        self.watch.close()
        self.guard.close()
        self._watches = []


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a key part with no plain equality: counted as differing
        return False


#: eager route of another thread's call: it waits for a recording under way (``Lifecycle.lock``)
THREAD = "thread"
_NO_LOCK = contextlib.nullcontext()


class Entry:
    """What the three entry points share: the route, the read-outs, retire and release. A subclass
    sets ``lifecycle`` (:meth:`_lifecycle`), ``on`` (its :class:`Switches`), ``_recordings`` and
    ``_refused`` (by key), ``max_recordings``, ``backend``, ``_pool`` and ``_calls``; it writes its
    own key, record and replay, and names its extra checks in :meth:`early_checks` and
    :meth:`late_checks`."""

    #: the entry point's kind, as ``__repr__`` names it
    kind: ClassVar[str] = "Entry"
    #: its recording key's parts in order, by their :data:`NEW_PARTS` names
    key_parts: ClassVar[tuple[str, ...]] = ()
    lifecycle: Lifecycle
    journal: Journal  # the lifecycle's
    on: Switches
    backend: Any
    max_recordings: int
    _recordings: dict[tuple, Any]
    _refused: dict[tuple, str]
    _pool: MemoryPool | None
    _calls: int

    def _lifecycle(
        self, name: str, module: nn.Module, strict: bool, max_rerecords: int
    ) -> Lifecycle:
        """This entry point's lifecycle; its drop frees the recordings (weakly: no cycle keeps it alive)."""
        me = weakref.ref(self)
        life = Lifecycle(
            name,
            module,
            strict=strict,
            on=self.on,
            max_rerecords=max_rerecords,
            drop=lambda: (e := me()) is not None and e._drop_recordings(),
        )
        self.journal = life.journal  # a plain read: every replayed call ticks it
        return life

    @property
    def disabled(self) -> frozenset[str]:
        """The protections ``unsafe_disable`` switched off (``on`` is the same as booleans)."""
        return self.on.off

    def new_part(self, key: tuple, held: dict[tuple, Any]) -> str:
        """What sets ``key`` apart from the keys ``held``: the label (:attr:`key_parts`; parts after
        those are host reads) of its first part that differs from the held key it shares the
        longest beginning with, tallied for ``summary()``. Asked by a recording call only."""
        parts = self.key_parts
        shared = -1
        for other in held:
            same = next(
                (i for i, (a, b) in enumerate(zip(key, other, strict=False)) if not _same(a, b)),
                min(len(key), len(other)),
            )
            shared = max(shared, same)
        part = "" if shared < 0 else parts[shared] if shared < len(parts) else "host_reads"
        if part:
            self.lifecycle.recorded_for[part] += 1
        return part

    # ----------------------------------------------------------------- the route
    def early_checks(self) -> str | None:
        """The entry's own eager reason, asked before the owner thread (none by default)."""
        return None

    def late_checks(self, call: int) -> str | None:
        """The entry's own eager reason, asked after autograd's mode and before the gate (none by default)."""
        return None

    def admit(self, call: int) -> tuple[Any, str | None]:
        """May this call replay at all? ``(state key, None)``, or ``(None, eager reason)``. stopped
        -> :meth:`early_checks` -> owner thread -> mode -> :meth:`late_checks` -> gate."""
        settle()  # what a collected recording's hand-outs put off while a capture ran
        life = self.lifecycle
        if life.retired or life.released:
            return None, "retired" if life.retired else "released"
        why = self.early_checks()
        if why is not None:
            return None, why
        if life.owner != _get_ident() and not life.owns_thread():  # the owner's calls: one C call
            return None, THREAD
        why = life.mode()
        if why is None:
            why = self.late_checks(call)
        if why is not None:
            return None, why
        return life.gate(call, bool(self._recordings))

    def choose(self, table: dict[tuple, Any], key: tuple, call: int) -> tuple[Any, str | None]:
        """``table``'s entry for ``key`` (None: record one), or ``(None, eager reason)``. refused ->
        budget -> pool. A refused key wins over a recording it still has (a network's reentry
        refuses a signature whose backward is pending)."""
        if self._refused:
            refused = self._refused.get(key)
            if refused is not None:
                return None, refused
        chosen = table.get(key)
        if chosen is None and len(table) >= self.max_recordings:
            return None, "budget"
        pool = self._pool
        if pool is not None and not pool.claim(self, call, self.on.shared_pool):
            return None, "pool_busy"
        return chosen, None

    def held(self, reason: str) -> contextlib.AbstractContextManager:
        """What an eager route runs under: another thread's call holds the lock (a recording under way finishes first)."""
        return self.lifecycle.lock if reason == THREAD else _NO_LOCK

    # ----------------------------------------------------------------- read-outs
    @property
    def strict(self) -> bool:
        return self.lifecycle.strict

    @property
    def retired(self) -> bool:
        return self.lifecycle.retired

    @property
    def retire_reason(self) -> str | None:
        return self.lifecycle.retire_reason

    @property
    def released(self) -> bool:
        return self.lifecycle.released

    @property
    def counts(self) -> dict[str, int]:
        """Events by kind (every kind of :data:`replaykit.journal.KINDS`), exact however long the run."""
        return self.lifecycle.counts

    @property
    def eager_reasons(self) -> Counter[str]:
        """Eager routes by reason, exact however long the run."""
        return self.lifecycle.eager_reasons

    def summary(self) -> str:
        """One line of counts, eager reasons and state."""
        return self.lifecycle.summary()

    @property
    def recordings(self) -> int:
        """How many recordings are held now."""
        return len(self._recordings)

    def _label(self) -> str:
        """What ``__repr__`` names before the state: the kind and what it replays."""
        return self.kind

    def __repr__(self) -> str:
        life = self.lifecycle
        state = (
            f"retired: {life.retire_reason}" if life.retired else f"{self.recordings} recordings"
        )
        return f"<{self._label()} {state} {self.counts}>"

    # ----------------------------------------------------------------- memory
    def _memory_rows(self) -> list[dict[str, Any]]:
        """Per recording: ``signature`` and the bytes of its ``static_inputs``, ``static_outputs``, ``static_grads``."""
        return []

    def memory(self) -> dict[str, Any]:
        """The bytes each recording holds (static inputs, outputs, gradient buffers: distinct
        storages), their sum, and the bytes its memory pool reserves on the GPU (``pool_reserved``:
        None on the emulated backend or without graphs; a shared pool's whole size)."""
        rows = self._memory_rows()
        for row in rows:
            row["bytes"] = row["static_inputs"] + row["static_outputs"] + row["static_grads"]
        backend = self.backend
        return {
            "recordings": rows,
            "static_bytes": sum(r["bytes"] for r in rows),
            "pool_reserved": backend.pool_reserved() if backend is not None else None,
        }

    # ----------------------------------------------------------------- retire, release, drop
    def _retire(self, reason: str, call: int, cause: BaseException | None = None) -> None:
        self.lifecycle.retire(reason, call, cause)

    def retire(self, reason: str = "retired by the user") -> None:
        """Run eagerly for good: recordings and static memory are freed; training goes on eagerly."""
        self.lifecycle.retire(reason, self._calls, user=True)

    def release(self) -> None:
        """Free every recording; later calls run eagerly (reason ``released``). Not a retirement."""
        self._release()

    def _release(self) -> bool:
        """Release and leave a shared pool; False when released already."""
        released = self.lifecycle.release(self._calls)
        if self._pool is not None:
            self._pool.leave(self)
        return released

    def _drop_recordings(self) -> None:
        """The lifecycle's drop (re-record, retire, release): free every recording."""
        raise NotImplementedError


def signature_of(static_inputs: list) -> str:
    """A recording's input shapes, as ``memory()`` names them: ``4/8x4``."""
    return "x".join("/".join(map(str, x.shape)) for x in static_inputs)
