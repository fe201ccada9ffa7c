"""The recorder: what a captured module's call does on the route: record, replay, or eager with a reason.

It adds to :class:`~replaykit.route.Entry` its checks (``paused`` early; ``eval``, the hold and
reentry late), its key, and what it keeps (plans, aliases, the hold). The recording call is in
:mod:`.recording`, the replayed call in :mod:`.replayed_call`: mixins over this state.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .backends import Backend, Recording, module_device
from .errors import ReplayError, ReplayWarning
from .guards.code import ForwardInputs
from .guards.fills import Fills
from .guards.host_choices import HostChoices
from .guards.input_reads import InputReads
from .guards.recurrent import flat_weights_follow
from .guards.signature import (
    SIGNATURE_PARTS,
    CallArgs,
    UnhashableArgument,
    arguments_written,
    signature,
    split_call,
)
from .memory.attribute_outputs import AttributeOutputs
from .memory.copy_out import StaticAliases
from .memory.hold import Hold
from .memory.layout import aligned_copy, aligned_key
from .memory.pool import MemoryPool, storage_bytes
from .memory.reentry import FirstUse
from .memory.write_back import WriteBack
from .protections import Switches
from .recording import Made, RecorderRecording
from .replayed_call import Plan, RecorderReplay
from .route import Entry, signature_of

#: where a captured module keeps its recorder (``rk.recorder_of`` reads it)
RECORDER_ATTR = "_replaykit_recorder"


class _RoutedForward:
    """The ``forward`` a captured module gets; a deep copy of the module gets its class's forward."""

    __slots__ = ("module", "recorder")

    def __init__(self, recorder: Recorder, module: nn.Module) -> None:
        self.recorder = recorder
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.recorder._route(args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.module))
        if copy is None:
            raise ReplayError("a captured module's forward cannot be copied on its own")
        return type(copy).forward.__get__(copy)

    def __reduce__(self) -> tuple:
        """Pickled (``torch.save`` of a whole module) as the class's own forward: a plain module loads."""
        return (_class_forward, (self.module,))


def _class_forward(module: nn.Module) -> Any:
    return type(module).forward.__get__(module)


def _nothing() -> None:
    return None


class Recorder(RecorderRecording, RecorderReplay, Entry):
    """Records a module's forward+backward per input signature and replays them. Made by
    :func:`replaykit.capture`; read ``journal``, ``counts``, ``eager_reasons``, ``retired``; call
    ``retire(reason)``, ``paused()`` or ``release()``."""

    kind = "Recorder"
    key_parts = ("state", "forward_reads", *SIGNATURE_PARTS)  # _route's key

    def __init__(
        self,
        module: nn.Module,
        backend: Backend,
        warmup: int,
        max_recordings: int,
        strict: bool,
        disabled: frozenset[str],
        check_every: int = 0,
        multi_backward: bool = False,
        max_rerecords: int = 8,
        pool: MemoryPool | None = None,
    ) -> None:
        self.module: nn.Module | None = module
        self.module_name = type(module).__name__
        self.backend = backend
        self.warmup = warmup
        self.max_recordings = max_recordings
        self.on = on = Switches(disabled)
        self.check_every = check_every
        self.multi_backward = multi_backward
        me = weakref.ref(self)  # neither the hold nor the lifecycle may keep their recorder alive
        self.lifecycle = self._lifecycle(
            f"{self.module_name} recorder", module, strict, max_rerecords
        )
        self._device_kind = _device_kind(module, backend)
        self._calls = 0
        self._replays = 0  # forward replays of any recording: a generation for retained graphs
        self._replayed_calls = 0  # calls routed to replay (the shadow check samples them)
        self._recordings: dict[tuple, Recording] = {}
        self._refused: dict[tuple, str] = {}  # signatures the probe refused, with the eager route
        self._plans: dict[tuple, Plan] = {}  # per recording: what its replays need
        self._aliases: dict[tuple, StaticAliases] = {}
        self._hold = Hold(lambda call: (r := me()) is not None and r._on_hold_end(call, "dropped"))
        self._first_use = FirstUse()
        # the plain values the tree's own classes read outside it (class attributes, globals): keyed
        inputs = ForwardInputs(module) if on.forward_inputs else None
        self._forward_inputs = inputs if inputs is not None and inputs.key() else None
        # host reads of input-derived values: found at the probe, keyed per call (a padded batch, an unpadded one)
        self._input_reads = InputReads(keyed=on.input_reads)
        # Python's and numpy's draws that only choose (LayerDrop): learnt at the probe, drawn and keyed per call
        self._choices = HostChoices(keyed=on.host_choices)
        self._not_recorded = "retired"  # why the last call that could not record ran eagerly
        # set once a capture failed on a host-to-device copy (host_feeds.py); once torch's CPU
        # generator was drawn from beside a GPU model (the next probe learns the draws)
        self._feed_host = self._learn_draws = False
        self._fills = Fills()  # writes into the model: a first write, a cache, per-call Python
        self._attributes = AttributeOutputs(module, self.lifecycle.guard.key_by_kind)
        self._free_after_backward = self._arguments_written = False  # see _forward_of
        self._dropout_buffers: list[torch.Tensor] = []  # cuDNN's, seen by a recording call
        # the plan of the replayed call whose backward is pending
        self._pending_plan: Plan | None = None
        self._paused = 0
        self._pool = pool  # shared with other entry points (None: the backend's private pool)
        if pool is not None:
            pool.join(self)
        self._own_forward = "forward" in module.__dict__
        self._forward = module.forward
        module.forward = _RoutedForward(self, module)
        setattr(module, RECORDER_ATTR, self)

    # the recording call's names for its switches (it is rewritten on branch ``record``)

    # ----------------------------------------------------------------- read-outs (journal, counts, ... : Entry)

    @property
    def backward_reasons(self) -> Counter[str]:
        """Backwards run eagerly through the recorded graph, by reason (``partial``, ``layout``, ``retained``, ...)."""
        return Counter(self.journal.backward_reasons)

    def __deepcopy__(self, memo: dict) -> None:
        """A deep copy of a captured module is a plain module: it gets no recorder."""
        return None

    def __reduce__(self) -> tuple:
        """A pickled captured module loads as a plain module: its recorder pickles as None."""
        return (_nothing, ())

    def _label(self) -> str:
        return f"Recorder {self.module_name} backend={self.backend.name}"

    @contextmanager
    def paused(self) -> Iterator[Recorder]:
        """Calls inside the block run eagerly (reason ``paused``), e.g. a double-backward step."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    # ----------------------------------------------------------------- memory
    def _memory_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "signature": signature_of(recording.static_inputs),
                "static_inputs": storage_bytes(recording.static_inputs),
                "static_outputs": storage_bytes(recording.static_outputs),
                "static_grads": storage_bytes(recording.static_grads),
            }
            for recording in self._recordings.values()
        ]

    def quiesce(self, call: int) -> bool:
        """A shared pool's question before another entry point runs there: copy out what was
        handed out; False while a replayed call's backward is pending (it reads static memory)."""
        if self._hold.active:
            return False
        return self._copy_out(self._calls)  # journaled at its own latest call

    def static_tensors(self) -> list[torch.Tensor]:
        """The static outputs and gradient buffers of every recording (what another graph in a shared pool may overwrite)."""
        return [
            t
            for recording in self._recordings.values()
            for t in (*recording.static_outputs, *recording.static_grads)
            if t is not None
        ]

    # ----------------------------------------------------------------- routing
    def _route(self, args: tuple, kwargs: dict) -> Any:
        self._calls += 1
        call = self._calls
        state, why = self.admit(call)
        if why is None:
            try:  # the key: the module's state, the signature, what the forward reads beside it
                callargs = split_call(args, kwargs)
                # by alignment, not storage offset (as the whole step): batches sliced from one
                # preloaded tensor (``X[i:i+b]``, truncated BPTT's ``source[i:i+bptt]``) share a
                # recording instead of recording one per offset and then running eagerly (budget)
                layout = aligned_key if self.on.input_layout else None
                key = (
                    state,
                    self._forward_inputs.key() if self._forward_inputs is not None else (),
                    *signature(callargs, self._device_kind, self.on.argument_values, layout),
                )
                key = self._choices.key(self._input_reads.key(key, callargs.tensors))
            except UnhashableArgument as exc:
                why = exc.reason
            else:
                plan, why = self.choose(self._plans, key, call)
                if plan is not None and plan.back is not None:  # it writes an input
                    why = plan.back.refusal(callargs.tensors)
                if why is not None or plan is None or not plan.cleared:
                    self._choices.rewind()  # the call's own runs draw (eager, or recording)
        if why is not None:
            with self.held(why):
                return self._eager(call, why, args, kwargs)
        if plan is None:
            if not self._copy_out(call) and (why := self._give_away(call)) is not None:
                return self._eager(call, why, args, kwargs)
            return self._record_and_run(call, callargs, key, args, kwargs)
        if not plan.cleared:
            return self._first_use_call(call, plan, args, kwargs)
        if not self._copy_out(call):  # held gradients given away: every recording made anew
            self._choices.rewind()
            why = self._give_away(call)
            if why is not None:
                return self._eager(call, why, args, kwargs)
            return self._record_and_run(call, callargs, key, args, kwargs)
        self.journal.tick("replay", call)
        return self._replay(call, plan, callargs, args, kwargs)

    def _record_and_run(
        self, call: int, callargs: CallArgs, key: tuple, args: tuple, kwargs: dict
    ) -> Any:
        """Record this call's signature and run the call: replayed (verified), or eager."""
        with self.lifecycle.lock:
            plan = self._record(call, callargs, key)
        if plan is None:
            return self._eager(call, self._not_recorded, args, kwargs)
        shadow, plan.shadow = plan.shadow, None
        if not plan.cleared:  # used eagerly first: its first replay verifies it
            return self._first_use_call(call, plan, args, kwargs)
        return self._replay(call, plan, callargs, args, kwargs, shadow)

    def early_checks(self) -> str | None:
        """Inside ``paused()``: eager."""
        return "paused" if self._paused else None

    def late_checks(self, call: int) -> str | None:
        """Eval mode; the hold (a replayed call's backward is pending); a watched first use called again."""
        if not self.module.training:
            return "eval"
        if self.on.hold and self._hold.active:
            self._reentered(call)
            return "hold"
        if self._first_use.pending:
            self._refuse_reentry(self._first_use.take(), call)
        return None

    def _first_use_call(self, call: int, plan: Plan, args: tuple, kwargs: dict) -> Any:
        """A recording at risk of reentry (``reentry.py``) is first used eagerly, watched for a
        second call before this one's backward."""
        out = self._eager(call, "first_use", args, kwargs)
        self._first_use.begin(out, plan, lambda: setattr(plan, "cleared", True))
        return out

    def _refuse_reentry(self, plan: Plan, call: int) -> None:
        """Called again before a watched first use's backward: eager would share work between
        the two calls, so that signature runs eagerly (exact: every call so far was)."""
        if self._plans.get(plan.key) is not plan:
            return
        reason, why = _reentry_reason(plan)
        self._drop_plan(plan.key)
        self._refused[plan.key] = reason
        self.journal.add(
            "refuse",
            call,
            reason,
            f"{self.module_name} is called again before the previous call's backward and {why}: "
            "the signature runs eagerly",
        )

    def _reentered(self, call: int) -> None:
        """Called again while a replayed call's backward is pending: eager shares work between the two
        calls (a parameter read twice, autocast's cast cache) that the graph did alone, so gradients may
        differ in the last bits. Said once; the signature runs eagerly from now on (exact).
        """
        plan = self._pending_plan
        if plan is None or plan.key in self._refused or not self.on.reentry:
            return
        if not plan.multi_use and not (
            plan.autocast
            and torch.is_autocast_enabled(self._device_kind)
            and torch.is_autocast_cache_enabled()
        ):
            return
        reason, why = _reentry_reason(plan)
        self._refused[plan.key] = reason
        detail = (
            f"{self.module_name} is called again while a replayed call's backward is pending, and {why}: "
            "this step's gradients may differ from eager in the last bits; the signature runs eagerly from now on"
        )
        self.journal.add("warned", call, reason, detail)
        warnings.warn(f"replaykit: {detail}", ReplayWarning, stacklevel=4)

    def _eager(self, call: int, reason: str, args: tuple, kwargs: dict) -> Any:
        self.lifecycle.eager(call, reason)
        return self._call_forward(*args, **kwargs)

    def _call_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward as eager calls it now: its own, or the one its class has now (a
        script may rebind ``Model.forward``; the key then records anew, guards/code.py)."""
        if self._own_forward:
            return self._forward(*args, **kwargs)
        module = self.module
        return type(module).forward.__get__(module)(*args, **kwargs)

    def _run_forward(
        self,
        callargs: CallArgs,
        originals: list[torch.Tensor],
        *tensors: torch.Tensor,
        params: list[torch.Tensor] | None = None,
    ) -> Any:
        """The module's own forward on ``tensors``; with ``params``, those stand in for ``originals``."""
        args, kwargs = callargs.rebuild(tensors)
        if params is None:
            out = self._call_forward(*args, **kwargs)
        else:
            with self.lifecycle.lock, stand_ins(self.module, originals, params):
                out = self._call_forward(*args, **kwargs)
        # the rebuilt containers are not the caller's: a write into one is seen here, not there
        self._arguments_written |= arguments_written(callargs, args, kwargs, tensors)
        return out

    def _record(self, call: int, callargs: CallArgs, key: tuple) -> Plan | None:
        """The recording call (the route's entry): its steps are in :mod:`.recording`; a kept
        recording gets its plan here. None: not recorded (``_not_recorded``: the eager route)."""
        made = self._record_call(call, callargs, key)
        return None if made is None else self._keep(made, call, callargs)

    def _keep(self, made: Made, call: int, callargs: CallArgs) -> Plan:
        """A recording that stands: kept under its key with the plan its replays read."""
        key, recording = made.key, made.recording
        new = self.new_part(key, self._recordings)
        self._recordings[key] = recording
        plan = self._plans[key] = Plan(
            key,
            recording,
            [made.params[i] for i in made.saved],
            made.saved_inputs if self.on.input_versions or self.on.input_rewrites else [],
            self.on.live_outputs,
            [
                *self.module.parameters(),
                *self.module.buffers(),
            ],  # memory the recording does not own
        )
        plan.shadow = made.shadow
        plan.written, plan.generators = list(made.written), list(made.generators)
        plan.inputs_written = tuple(made.written_inputs)
        plan.assignment = made.assignment
        plan.grad_order = list(made.grad_order) if self.on.hook_order else []
        if self.on.write_back:
            plan.back = WriteBack.of(recording.static_inputs, made.written_inputs)
        twice = set(made.multi_use)
        plan.autocast = (
            torch.is_autocast_enabled(self._device_kind) and torch.is_autocast_cache_enabled()
        )
        plan.multi_use = [n for i, (n, _) in enumerate(made.named) if i in twice]
        plan.cleared = self._clears(made)
        self._aliases[key] = plan.aliases
        self._guard_new_grads(plan)
        shapes = ", ".join("x".join(map(str, t.shape)) for t in callargs.tensors)
        new = f" (new {new})" if new else ""
        self.journal.add("record", call, None, f"[{shapes}] recording {len(self._recordings)}{new}")
        return plan

    def _static_inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Private copies of the inputs, in the caller's layout (sizes, strides, address alignment)
        and with the caller's aliasing. A kernel's reduction order can depend on strides and
        alignment, so an expanded or sliced input copied into a contiguous buffer could sum
        differently from eager."""
        exact = self.on.input_layout
        same = self.on.input_aliasing
        made: dict[int, torch.Tensor] = {}
        out = []
        for t in tensors:
            if same and id(t) in made:
                out.append(made[id(t)])
                continue
            static = aligned_copy(t) if exact else t.detach().clone()
            static.requires_grad_(t.requires_grad)
            made[id(t)] = static
            out.append(static)
        return out

    def _drop_plan(self, key: tuple) -> None:
        """One signature's recording goes: holders of its static memory keep copies."""
        aliases = self._aliases.pop(key, None)
        if aliases is not None:
            aliases.copy_out()
        plan = self._plans.pop(key, None)
        recording = self._recordings.pop(key, None)
        if plan is not None:
            plan.free()
        if recording is not None:
            recording.free()

    def _on_hold_end(self, call: int, reason: str) -> None:
        self._pending_plan = None
        self.journal.tick("hold_end", call, reason)
        if self._free_after_backward and reason == "dropped":
            self._free_recordings()

    # ----------------------------------------------------------------- retirement (retire: Entry)
    def _drop_recordings(self) -> None:
        """The lifecycle's drop (re-record, retire, release): free every recording now, or after
        the pending backward that still reads one."""
        self._refused.clear()
        if self._hold.active:
            self._free_after_backward = True
        else:
            self._free_recordings()

    def _free_recordings(self) -> None:
        for aliases in self._aliases.values():
            aliases.copy_out()  # reachable holders keep valid values without pinning static memory
        self._aliases.clear()
        for plan in self._plans.values():
            plan.free()
        self._plans.clear()
        for recording in self._recordings.values():
            recording.free()
        self._recordings.clear()
        self.backend.free()
        self._free_after_backward = False
        self._pending_plan = None
        self._first_use.clear()

    def release(self) -> None:
        """Restore ``module.forward`` and free everything; safe to call twice. Not a retirement."""
        self._hold.clear()
        if not self._release():
            return
        module = self.module
        assert module is not None
        if self._own_forward:
            module.forward = self._forward
        else:
            module.__dict__.pop("forward", None)
        module.__dict__.pop(RECORDER_ATTR, None)
        self.module = None  # a released recorder keeps its journal, not the module
        self._forward = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def stand_ins(
    module: nn.Module, originals: list[torch.Tensor], leaves: list[torch.Tensor]
) -> Iterator[None]:
    """Put ``leaves`` where ``originals`` sit in the tree's ``_parameters`` dicts, and back. Each
    dict once, so a module registered under two names (ALBERT's block) is restored, which
    ``torch.nn.utils.stateless`` is not; tied parameters get one leaf; plain dict writes, unseen by
    the guards."""
    swap = {id(p): leaf for p, leaf in zip(originals, leaves, strict=True)}
    entries = [
        (m._parameters, k, v)
        for m in module.modules()
        for k, v in m._parameters.items()
        if id(v) in swap
    ]
    for d, k, v in entries:
        dict.__setitem__(d, k, swap[id(v)])
    try:
        # an RNN's weight cache follows (replaykit/guards/recurrent.py)
        with flat_weights_follow(module):
            yield
    finally:
        for d, k, v in entries:
            dict.__setitem__(d, k, v)


def _reentry_reason(plan: Plan) -> tuple[str, str]:
    """Why a second call before a backward shares work with the first in eager (``reentry.py``)."""
    if plan.multi_use:
        return (
            "reentrant_shared_weight",
            f"its recording reads {plan.multi_use[0]} more than once (gradient summation order)",
        )
    return (
        "autocast_shared_region",
        "both calls run under autocast, which casts each parameter once for both in eager",
    )


def _device_kind(module: nn.Module, backend: Backend) -> str:
    """The device type whose autocast state enters signatures."""
    device = getattr(backend, "device", None) or module_device(module)
    return device.type if device is not None else "cpu"
