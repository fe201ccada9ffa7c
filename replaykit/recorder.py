"""The recorder: routes every call of a captured module to record, replay, or eager with a reason.

One module (about 900 lines) because routing, recording, the replayed forward and backward
and retirement all read and write the same per-recorder state (recordings, aliases, the
hold, the journal); the concepts they use live in modules of their own (signature, guards,
probe, hold, copy_out, retirement, shadow, backends). ``capture`` is at the end.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .backends import Backend, Recording, module_device, resolve_backend
from .compiled import CompileWatch, aot_compiled, compiled_regions, refuse_cudagraphs
from .errors import ReplayError, ReplayWarning, check_count
from .guards.code import ForwardInputs
from .guards.input_reads import InputReads, Provenance
from .guards.module import host_dependence, tree_contains
from .guards.signature import CallArgs, UnhashableArgument, signature, split_call
from .memory.copy_out import StaticAliases
from .memory.hold import Hold, PendingBackward
from .memory.layout import copy_into, same_layout
from .memory.outputs import OutputTree
from .memory.pool import MemoryPool, check_pool, storage_bytes
from .memory.reentry import FirstUse
from .protections import disabled_protections
from .recurrent import flat_weights_follow
from .route import Lifecycle, Lifecycled
from .verify.contexts import recording as recording_context
from .verify.probe import probe
from .verify.shadow import Shadow
from .verify.snapshot import StateSnapshot

_RECORDER_ATTR = "_replaykit_recorder"
_VERSION = operator.attrgetter("_version")
_detach = torch.Tensor.detach


class _Replay(torch.autograd.Function):
    """Connects one replayed call to autograd: forward replays, backward replays its backward."""

    @staticmethod
    def forward(ctx: Any, step: _Step, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.step = step
        return step.recorder._forward_replay(
            ctx, step, tensors
        )  # the inputs come first, then the parameters

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        step: _Step = ctx.step
        if (
            not torch.is_grad_enabled()
        ):  # autograd runs a backward without create_graph in no-grad mode
            return (None, *step.recorder._backward_replay(step, grads))
        if "repeat_backward" not in step.recorder.disabled:
            step.recorder._refuse_double_backward(
                step
            )  # create_graph=True: replayed gradients carry no graph
        with torch.no_grad():
            return (None, *step.recorder._backward_replay(step, grads))


#: autograd's C entry point for _Replay: what Function.apply calls after its Python pass over the arguments
_apply_c = super(torch.autograd.Function, _Replay).apply
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _apply(
    step: _Step, inputs: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """``_Replay.apply(step, *inputs, *params)`` without ``Function.apply``'s generator over every argument.

    Outside functorch transforms, ``Function.apply`` unwraps dead functorch wrappers among
    its arguments (a Python step per argument: about 150 ns per parameter) and calls the C
    entry point. The inputs are unwrapped here as it does; the parameters are the
    recording's own, registered in the module (a swapped one routes eager), never wrappers.
    Inside a transform the ordinary path runs (and refuses, as before).
    """
    if _functorch_active():
        return _Replay.apply(step, *inputs, *params)
    return _apply_c(step, *map(_unwrap_if_dead, inputs), *params)


class _Plan:
    """One recording and what replaying it needs, gathered when it is recorded: a call looks nothing up by key."""

    __slots__ = (
        "aliases",
        "all_differentiable",
        "autocast",
        "cleared",
        "copies",
        "key",
        "multi_use",
        "recording",
        "saved",
        "saved_inputs",
        "shadow",
        "verified",
        "written",
    )

    def __init__(
        self,
        key: tuple,
        recording: Recording,
        saved: list[torch.Tensor],
        saved_inputs: list[int],
        guard_outputs: bool,
    ) -> None:
        self.multi_use: list[
            str
        ] = []  # parameters read more than once per call (their gradient is a sum inside it)
        self.autocast = False  # recorded under autocast with eager's cast cache on (see reentry.py)
        self.cleared = (
            True  # may replay: not at risk of reentry, or its watched first use ran its backward
        )
        self.key = key
        self.recording = recording
        self.verified = False  # until a replay of it matched eager (forward and backward)
        self.shadow: Shadow | None = (
            None  # the recording call's eager forward, made before the capture
        )
        self.written: list[torch.Tensor] = []  # parameters the forward writes in place
        self.saved = saved  # the parameters its backward reads: their versions are checked
        self.saved_inputs = saved_inputs  # the inputs (positions) it reads: likewise
        self.all_differentiable = recording.differentiable == tuple(
            range(len(recording.static_outputs))
        )
        # one write per distinct static input (aliased arguments share one), at its first position:
        # (position, its .data to copy into without a version bump, or None for a broadcast layout, the static)
        self.copies: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        for i, static in enumerate(recording.static_inputs):
            if all(static is not other for _, _, other in self.copies):
                self.copies.append((i, None if 0 in static.stride() else static.data, static))
        # after the .data aliases: their references are part of the use-count baseline (an output
        # that is a view of an input, possible with record_probe off, shares a static input's storage)
        self.aliases = StaticAliases(recording.static_outputs if guard_outputs else (), ())

    def free(self) -> None:
        """Let static memory go with the recording: a replayed call's autograd node (its step) may outlive it."""
        self.copies = []
        self.aliases = StaticAliases((), ())


class _Step:
    """What one replayed call's autograd node needs to know."""

    __slots__ = (
        "backwards",
        "call",
        "exact",
        "generation",
        "inputs",
        "pending",
        "plan",
        "recorder",
        "recording",
        "shadow",
        "versions",
    )

    def __init__(self, recorder: Recorder, plan: _Plan, call: int) -> None:
        self.recorder = recorder
        self.plan = plan
        self.recording = plan.recording
        self.call = call
        self.generation = 0
        self.pending: PendingBackward | None = None
        self.backwards = 0  # backwards run through this call so far
        self.exact = (
            False  # whether the first one left the activations untouched (eager through the graph)
        )
        self.shadow: Shadow | None = None
        self.versions: list[int] | None = None  # parameters' versions at the forward
        self.inputs: list[tuple[torch.Tensor, int]] | None = (
            None  # the saved inputs and their versions
        )


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


class Recorder(Lifecycled):
    """Records a module's forward+backward per input signature and replays them.

    Made by :func:`replaykit.capture`; see its docstring for the routes and the
    guarantees. Read ``journal``, ``counts``, ``eager_reasons``, ``retired`` and
    ``retire_reason``; call ``retire(reason)``, ``paused()`` or ``release()``.
    """

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
        self.disabled = disabled
        self.check_every = check_every
        self.multi_backward = multi_backward
        me = weakref.ref(
            self
        )  # neither the hold nor the lifecycle may keep their recorder alive (no cycle)
        self.lifecycle = Lifecycle(
            f"{self.module_name} recorder",
            module,
            strict=strict,
            disabled=disabled,
            max_rerecords=max_rerecords,
            drop=lambda: (r := me()) is not None and r._drop_recordings(),
        )
        self._device_kind = _device_kind(module, backend)
        self._calls = 0
        self._replays = 0  # forward replays of any recording: a generation for retained graphs
        self._replayed_calls = 0  # calls routed to replay (the shadow check samples them)
        self._recordings: dict[tuple, Recording] = {}
        self._refused: dict[tuple, str] = {}  # signatures the probe refused, with the eager route
        self._plans: dict[tuple, _Plan] = {}  # per recording: what its replays need
        self._guard_grads = "copy_out" not in disabled
        self._guard_outputs = "live_outputs" not in disabled
        self._verify = "verify_recording" not in disabled
        self._aliases: dict[tuple, StaticAliases] = {}
        self._hold = Hold(lambda call: (r := me()) is not None and r._on_hold_end(call, "dropped"))
        self._hold_enabled = "hold" not in disabled
        self._reentry_said = "reentry" not in disabled
        self._first_use = FirstUse()
        self._exact_none = "none_pattern" not in disabled
        self._check_versions = "inplace_weights" not in disabled
        self._check_inputs = "input_versions" not in disabled
        self._key_state = "module_state" not in disabled  # flags, not a frozenset lookup per call
        self._exact_arguments = "argument_values" not in disabled
        self._check_constants = "output_constants" not in disabled
        # the plain values the tree's own classes read outside it (class attributes, globals): keyed
        inputs = ForwardInputs(module) if "forward_inputs" not in disabled else None
        self._forward_inputs = inputs if inputs is not None and inputs.key() else None
        # host reads of input-derived values: found at the probe, keyed per call (a padded batch, an unpadded one)
        self._input_reads = InputReads(keyed="input_reads" not in disabled)
        self._not_recorded = "retired"  # why the last call that could not record ran eagerly
        self._first_write = False  # a call routed eager for a write into the model (once)
        self._free_after_backward = False
        self._pending_plan: _Plan | None = (
            None  # the plan of the replayed call whose backward is pending
        )
        self._paused = 0
        self._pool = pool  # shared with other entry points (None: the backend's private pool)
        self._pool_safe = "shared_pool" not in disabled
        if pool is not None:
            pool.join(self)
        self._own_forward = "forward" in module.__dict__
        self._forward = module.forward
        module.forward = _RoutedForward(self, module)
        setattr(module, _RECORDER_ATTR, self)

    # ----------------------------------------------------------------- read-outs (journal, counts, ... : Lifecycled)

    @property
    def backward_reasons(self) -> Counter[str]:
        """Backwards run eagerly through the recorded graph, by reason (``partial``, ``layout``, ``retained``, ...)."""
        return Counter(self.journal.backward_reasons)

    @property
    def recordings(self) -> int:
        """How many recordings are held now."""
        return len(self._recordings)

    def __deepcopy__(self, memo: dict) -> None:
        """A deep copy of a captured module is a plain module: it gets no recorder."""
        return None

    def __reduce__(self) -> tuple:
        """A pickled captured module loads as a plain module: its recorder pickles as None."""
        return (_nothing, ())

    def __repr__(self) -> str:
        state = (
            f"retired: {self.retire_reason}" if self.retired else f"{self.recordings} recordings"
        )
        return f"<Recorder {self.module_name} backend={self.backend.name} {state} {self.counts}>"

    @contextmanager
    def paused(self) -> Iterator[Recorder]:
        """Calls inside the block run eagerly (reason ``paused``), e.g. a double-backward step."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    # ----------------------------------------------------------------- memory
    def memory(self) -> dict[str, Any]:
        """The bytes each recording holds (static inputs, outputs, gradient buffers: distinct
        storages), their sum, and the bytes its memory pool reserves on the GPU (``pool_reserved``:
        None on the emulated backend; a shared pool's whole size)."""
        rows = [
            {
                "signature": "x".join("/".join(map(str, x.shape)) for x in recording.static_inputs),
                "static_inputs": storage_bytes(recording.static_inputs),
                "static_outputs": storage_bytes(recording.static_outputs),
                "static_grads": storage_bytes(recording.static_grads),
            }
            for recording in self._recordings.values()
        ]
        for row in rows:
            row["bytes"] = row["static_inputs"] + row["static_outputs"] + row["static_grads"]
        return {
            "recordings": rows,
            "static_bytes": sum(r["bytes"] for r in rows),
            "pool_reserved": self.backend.pool_reserved(),
        }

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
        life = self.lifecycle
        stopped = life.stopped()
        if stopped is not None:
            return self._eager(call, stopped, args, kwargs)
        if self._paused:
            return self._eager(call, "paused", args, kwargs)
        if not life.owns_thread():
            with life.lock:
                return self._eager(call, "thread", args, kwargs)
        mode = life.mode()
        if mode is not None:
            return self._eager(call, mode, args, kwargs)
        if not self.module.training:
            return self._eager(call, "eval", args, kwargs)
        if self._hold_enabled and self._hold.active:
            self._reentered(call)
            return self._eager(call, "hold", args, kwargs)
        if self._first_use.pending:
            self._refuse_reentry(self._first_use.take(), call)
        state, eager = life.gate(call, bool(self._recordings))
        if eager is not None:
            return self._eager(call, eager, args, kwargs)
        try:
            callargs = split_call(args, kwargs)
            key = (
                state if self._key_state else None,
                *signature(callargs, self._device_kind, self._exact_arguments),
            )
            if self._forward_inputs is not None:
                key = (*key, self._forward_inputs.key())
            key = self._input_reads.key(key, callargs.tensors)
        except UnhashableArgument as exc:
            return self._eager(call, exc.reason, args, kwargs)
        refused = self._refused.get(key)
        if refused is not None:
            return self._eager(call, refused, args, kwargs)
        plan = self._plans.get(key)
        if plan is None and len(self._recordings) >= self.max_recordings:
            return self._eager(call, "budget", args, kwargs)
        if self._pool is not None and not self._pool.claim(self, call, self._pool_safe):
            return self._eager(call, "pool_busy", args, kwargs)
        if plan is None:
            if not self._copy_out(call):
                return self._eager(call, "live_alias", args, kwargs)
            with life.lock:
                plan = self._record(call, callargs, key)
            if plan is None:
                return self._eager(call, self._not_recorded, args, kwargs)
            shadow, plan.shadow = plan.shadow, None
            if not plan.cleared:  # used eagerly first: its first replay verifies it
                return self._first_use_call(call, plan, args, kwargs)
            return self._replay(call, plan, callargs, args, kwargs, shadow)
        if not plan.cleared:
            return self._first_use_call(call, plan, args, kwargs)
        if not self._copy_out(call):
            return self._eager(call, "live_alias", args, kwargs)
        self.journal.tick("replay", call)
        return self._replay(call, plan, callargs, args, kwargs)

    def _early_shadow(
        self,
        callargs: CallArgs,
        params: list[torch.Tensor],
        snapshot: StateSnapshot,
        written: list[torch.Tensor],
    ) -> Shadow | None:
        """The verification's eager forward, run after the probe and before the warm-up and capture,
        from the state before the call: eager's activations come and go before the recording's
        static memory exists, never beside it."""
        if not self._verify:
            return None
        snapshot.restore()  # what the probe changed (statistics, RNG) is put back first
        # an error here is the recording's: it retires with "capture failed: ..."
        return Shadow(
            self.module,
            partial(self._run_forward, callargs, params),
            callargs.tensors,
            params,
            written,
        )

    def _first_use_call(self, call: int, plan: _Plan, args: tuple, kwargs: dict) -> Any:
        """A recording at risk of reentry (``reentry.py``) is first used eagerly, watched for a
        second call before this one's backward."""
        out = self._eager(call, "first_use", args, kwargs)
        self._first_use.begin(out, plan, lambda: setattr(plan, "cleared", True))
        return out

    def _refuse_reentry(self, plan: _Plan, call: int) -> None:
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
        """Called again while a replayed call's backward is pending. Eager shares work between the two
        calls that the replay did alone, so this step's gradients may differ from eager in the last
        bits: a parameter the recording reads twice gets its gradient pre-summed inside the graph
        (autograd adds this call's uses in another order), and under autocast eager casts each
        parameter once per region (its cache) and sums both calls' gradients in the low precision,
        where the graph cast its own copy. Said once, and the signature runs eagerly from now on
        (both calls then eager, so exact)."""
        plan = self._pending_plan
        if plan is None or plan.key in self._refused or not self._reentry_said:
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
        return self._forward(*args, **kwargs)

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
            return self._forward(*args, **kwargs)
        with self.lifecycle.lock, stand_ins(self.module, originals, params):
            return self._forward(*args, **kwargs)

    def _record(self, call: int, callargs: CallArgs, key: tuple) -> _Plan | None:
        life = self.lifecycle
        self._not_recorded = "retired"  # the eager route's reason when this returns None
        if not self._recordings:
            life.first_record()
        if life.watch.hooks_at_start:
            self._retire("module hooks inside the module would not run under replay", call)
            return None
        frozen = host_dependence(self.module)
        if (
            frozen is not None
        ):  # refused on both backends: the emulated one mirrors what a graph can do
            self._retire(frozen, call)
            return None
        if self.backend.name == "emulated" and "compiled_code" not in self.disabled:
            # refused before the probe runs compiled code the tape cannot see (compiled.py)
            regions = compiled_regions(self.module)
            if regions:
                self._retire(CompileWatch.unseen_reason(regions[0][0]), call)
                return None
        compiled = aot_compiled(self.module)
        if compiled is not None:
            # measured on the H200: a recording's backward runs inductor's compiled backward again
            # (the exact and verified backwards), which raises for the buffers it donates
            self._retire(
                f"{compiled} is torch.compile'd: its compiled backward donates its buffers, which network "
                "replay's backward cannot run again; use rk.TrainStep over the compiled model (it replays it)",
                call,
            )
            return None
        snapshot = StateSnapshot(self.module)
        static_inputs = self._static_inputs(callargs.tensors)
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        fn = partial(self._run_forward, callargs, params)
        saved = list(
            range(len(params))
        )  # the parameters the backward reads (all, unless the probe says)
        saved_inputs: list[int] = []  # the inputs it reads (none known without the probe)
        multi_use: list[int] = []  # the parameters it reads more than once
        written: list[torch.Tensor] = []  # the parameters it writes in place (frozen ones too)
        reads = Provenance(static_inputs, discover=True)
        probed: list[OutputTree] = []  # what the probe's forward returned besides tensors
        watch = CompileWatch(self.backend.name == "emulated", "compiled_code" not in self.disabled)
        try:
            refusal = (
                None
                if "record_probe" in self.disabled
                else probe(
                    self.module,
                    reads.wrap(fn),
                    static_inputs,
                    params,
                    saved,
                    "host_rng" not in self.disabled,
                    saved_inputs,
                    multi_use,
                    probed,
                    written,
                )
            )
            key = self._input_reads.settle(key, reads.reads)
            if refusal is None:
                shadow = self._early_shadow(callargs, params, snapshot, written)
                if (
                    reads.reads
                ):  # the recording is answered the values the probe read: no sync inside it
                    fn = Provenance(static_inputs, dict(reads.reads)).wrap(fn)
                with recording_context("capture_branches" not in self.disabled), watch:
                    recording = self.backend.record(fn, static_inputs, params, self.warmup)
                watch.check()
        except Exception as exc:
            snapshot.restore()
            if watch.recompiled():  # this call runs eagerly (compiling it); the next records
                self._not_recorded = "compiling"
                return None
            self._retire(f"capture failed: {type(exc).__name__}: {exc}", call, cause=exc)
            return None
        except (
            BaseException
        ):  # KeyboardInterrupt: leave nothing of the warm-up behind, record again later
            snapshot.restore()
            raise
        snapshot.restore()
        if refusal is not None:
            if refusal.scope == "signature":
                self._refused[key] = self._not_recorded = refusal.reason
                self.journal.add("refuse", call, refusal.reason, refusal.detail)
            elif refusal.scope == "call" and not self._first_write:
                # a write the first call makes (transformers sets config.problem_type): eager makes it, the
                # next call records; a write that happens again retires below
                self._first_write = True
                self._not_recorded = "first_write"
                self.journal.add("refuse", call, "first_write", refusal.reason)
            else:
                self._retire(refusal.reason, call)
            return None
        varying = self._varying_outputs(probed, recording)
        if varying is not None:
            recording.free()
            self._refused[key] = self._not_recorded = "output_constant"
            self.journal.add("refuse", call, "output_constant", varying)
            return None
        self._recordings[key] = recording
        plan = self._plans[key] = _Plan(
            key,
            recording,
            [params[i] for i in saved],
            saved_inputs if self._check_inputs else [],
            self._guard_outputs,
        )
        plan.shadow = shadow
        plan.written = list(written)
        twice = set(multi_use)
        plan.autocast = (
            torch.is_autocast_enabled(self._device_kind) and torch.is_autocast_cache_enabled()
        )
        plan.multi_use = [n for i, (n, _) in enumerate(named) if i in twice]
        plan.cleared = not (self._reentry_said and (plan.multi_use or plan.autocast))
        self._aliases[key] = plan.aliases
        self._guard_new_grads(plan)
        shapes = ", ".join("x".join(map(str, t.shape)) for t in callargs.tensors)
        self.journal.add("record", call, None, f"[{shapes}] recording {len(self._recordings)}")
        return plan

    def _varying_outputs(self, probed: list[OutputTree], recording: Recording) -> str | None:
        """The probe's call and the recorded one must return the same structure and constants
        (:mod:`replaykit.memory.outputs`): a replay hands back the recorded ones."""
        if not probed or not self._check_constants:
            return None
        difference = probed[0].difference(recording.out_spec)
        if difference is None:
            return None
        return f"{difference} (the probe's call, then the recording's): a replay would freeze one"

    def _static_inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Private copies of the inputs, in the caller's exact layout and with the caller's aliasing.

        A kernel's reduction order can depend on strides and offset, so an expanded or
        sliced input copied into a contiguous buffer could sum differently from eager.
        """
        exact = "input_layout" not in self.disabled
        same = "input_aliasing" not in self.disabled
        made: dict[int, torch.Tensor] = {}
        out = []
        for t in tensors:
            if same and id(t) in made:
                out.append(made[id(t)])
                continue
            static = same_layout(t) if exact else t.detach().clone()
            static.requires_grad_(t.requires_grad)
            made[id(t)] = static
            out.append(static)
        return out

    def _guard_new_grads(self, plan: _Plan) -> None:
        """Put static gradient buffers a recording has (now) under copy-out."""
        if not self._guard_grads:
            return
        recording = plan.recording
        params = recording.params
        grads = recording.static_grads[len(recording.static_grads) - len(params) :]
        plan.aliases.add_grads(
            [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
        )

    def _replay(
        self,
        call: int,
        plan: _Plan,
        callargs: CallArgs,
        args: tuple,
        kwargs: dict,
        shadow: Shadow | None = None,
    ) -> Any:
        recording = plan.recording
        step = _Step(self, plan, call)
        self._replayed_calls += 1
        verifying = self._verify and not plan.verified
        if shadow is not None:  # the recording call's, made before the recording
            step.shadow = shadow
        elif verifying or (self.check_every and (self._replayed_calls - 1) % self.check_every == 0):
            step.shadow = Shadow(
                self.module,
                partial(self._run_forward, callargs, recording.params),
                callargs.tensors,
                recording.params,
                plan.written,
            )
        outputs = _apply(step, callargs.tensors, recording.params)
        shadow = step.shadow
        if shadow is not None:
            difference = shadow.check_forward(self.module, outputs, recording.out_spec)
            self.journal.add("check", call, "forward", difference)
            if difference is not None:
                del outputs, step  # the hold ends with the discarded graph
                shadow.snapshot.restore()  # the state before this call: eager runs it again
                self._diverged(plan, difference, call, verifying)
                return self._forward(*args, **kwargs)
        plan.aliases.handed_out(outputs)
        return recording.build_outputs(outputs)

    # ----------------------------------------------------------------- the replayed call
    def _copy_out(self, call: int) -> bool:
        """Before any replay: no static storage of any recording may still be aliased."""
        copied, clean = 0, True
        for aliases in self._aliases.values():
            if aliases.dirty:
                n, ok = aliases.copy_out()
                copied += n
                clean = clean and ok
        if copied:
            self.journal.add("copy_out", call, None, f"{copied} tensors")
        return clean

    def _forward_replay(
        self, ctx: Any, step: _Step, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        plan, recording = step.plan, step.recording
        for i, data, static in plan.copies:  # like a graph's own writes: no autograd version bump
            if data is not None:
                data.copy_(tensors[i])
            else:
                copy_into(static, tensors[i])
        recording.replay_forward()
        if (
            self._check_versions
        ):  # what eager's saved-tensor check covers: the parameters the backward reads
            step.versions = list(map(_VERSION, plan.saved))
        if plan.saved_inputs:  # and the caller's inputs it reads
            step.inputs = [(tensors[i], tensors[i]._version) for i in plan.saved_inputs]
        self._replays += 1
        step.generation = self._replays
        if self._hold_enabled:
            # ctx (and so step) lives exactly as long as the pending autograd graph
            step.pending = self._hold.begin(step.call)
            self._pending_plan = plan
        outputs = tuple(map(_detach, recording.static_outputs))
        if recording.frozen_outputs:
            ctx.mark_non_differentiable(*[outputs[i] for i in recording.frozen_outputs])
        return outputs

    def _backward_replay(
        self, step: _Step, grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """One backward through a replayed call: replayed from the graph, or exact through the recorded graph."""
        plan, recording = step.plan, step.recording
        self._end_hold(step)
        self._check_activations(step)
        if step.versions is not None and list(map(_VERSION, plan.saved)) != step.versions:
            raise ReplayError(
                "replaykit: one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a parameter of {self.module_name} changed between replayed call {step.call} and its "
                "backward (eager raises here too)"
            )
        if step.inputs is not None and any(t._version != v for t, v in step.inputs):
            raise ReplayError(
                "replaykit: one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: an input of {self.module_name} changed between replayed call {step.call} and its "
                "backward (eager raises here too)"
            )
        wanted = (
            grads
            if plan.all_differentiable and self._exact_none
            else self._incoming(recording, grads)
        )
        step.backwards += 1
        if step.backwards > 1 and "repeat_backward" not in self.disabled:
            result, how = recording.exact_backward(wanted), "repeat"
        elif self.multi_backward:
            result, how = recording.exact_backward(wanted), "multi_backward"
        else:
            if recording.prepare_backward(
                wanted
            ):  # a backward graph was captured: its buffers join copy-out
                self._guard_new_grads(plan)
            result, how = recording.backward(wanted)
        step.exact = step.exact or how is not None
        if how is None:
            plan.aliases.handed_out_grads()
        else:
            self.journal.add("backward", step.call, how)
        result = self._leave_inputs(recording, result)
        if step.shadow is not None:
            result = self._check_backward(step, wanted, result)
        if self._free_after_backward:
            self._free_recordings()
        return result

    def _end_hold(self, step: _Step) -> None:
        if step.pending is not None:
            if self._hold.release(step.pending):
                self._on_hold_end(step.call, "backward")
            step.pending = None

    def _check_activations(self, step: _Step) -> None:
        """A backward may read this call's activations only if no later replay overwrote them."""
        if not step.recording.static_inputs:
            raise ReplayError("replaykit: the recording was freed before this backward ran")
        overwritten = self._replays != step.generation
        if overwritten and (self._hold_enabled or step.backwards):
            raise ReplayError(
                f"replaykit: backward of call {step.call} after a later replay overwrote its activations "
                "(a retained graph differentiated across replays)"
            )
        if step.backwards and "repeat_backward" not in self.disabled and not step.exact:
            raise ReplayError(
                f"replaykit: a second backward through replayed call {step.call} of {self.module_name} "
                "(retain_graph=True, or one autograd.grad per loss): the first one replayed the backward graph, "
                "whose temporaries may reuse the activations. Capture with multi_backward=True (backwards then run "
                "exactly through the recorded graph) or run that forward eagerly (with recorder.paused(): ...)"
            )

    def _incoming(
        self, recording: Recording, grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        wanted = [grads[i] for i in recording.differentiable]
        if self._exact_none:
            return wanted
        # unsafe: unread outputs get zeros, as plain CUDA graphs do
        return [
            torch.zeros_like(recording.static_outputs[i]) if g is None else g
            for i, g in zip(recording.differentiable, wanted, strict=True)
        ]

    @staticmethod
    def _leave_inputs(
        recording: Recording, result: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Input gradients leave as copies: their holders (x.grad of a new x each call) are unreachable."""
        needs = recording.inputs_requiring_grad
        if not any(needs):  # the usual case: no input gradient at all
            return [None] * len(needs) + list(result)
        it = iter(result)
        return [
            (None if (g := next(it)) is None else g.clone()) if req else None for req in needs
        ] + list(it)

    def _check_backward(
        self, step: _Step, wanted: list[torch.Tensor | None], result: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Shadow check of a backward: on a difference, retire and hand eager's gradients back."""
        shadow, recording = step.shadow, step.recording
        assert shadow is not None
        step.shadow = None
        assert self.module is not None
        reference, difference = shadow.reference_grads(
            self.module, recording.differentiable, wanted
        )
        if (
            reference is None
        ):  # nothing compared: a recording not verified yet is checked at its next replay
            return result
        needs = recording.inputs_requiring_grad
        ref = iter(reference)
        full = [next(ref) if req else None for req in needs] + list(ref)
        names = [f"input {i} grad" for i in range(len(needs))] + [
            f"grad {n}" for n in self._param_names(recording)
        ]
        if difference is None:
            difference = shadow.check_backward(names, full, result)
        else:  # eager has no one answer to hand back: the replay's gradients stand for this call
            full = result
        self.journal.add("check", step.call, "backward", difference)
        if difference is None:
            step.plan.verified = True
            return result
        self._diverged(step.plan, difference, step.call, self._verify and not step.plan.verified)
        return full

    def _diverged(self, plan: _Plan, difference: str, call: int, verifying: bool) -> None:
        """A replay differed from eager: a recording's first check routes its signature eager; a
        sampled check (``check_every``) of a verified one retires the recorder."""
        if not verifying:
            self._retire(f"diverged: {difference}", call)
            return
        self._refused[plan.key] = "diverged"
        self.journal.add(
            "refuse", call, "diverged", f"the recording differs from eager: {difference}"
        )
        self._drop_plan(plan.key)

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

    def _param_names(self, recording: Recording) -> list[str]:
        names = (
            {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
        )
        return [names.get(id(p), "?") for p in recording.params]

    def _refuse_double_backward(self, step: _Step) -> None:
        self._end_hold(step)
        self._retire("create_graph=True (double backward) through a replayed call", step.call)
        raise ReplayError(
            f"replaykit: create_graph=True through replayed call {step.call} of {self.module_name}: replayed "
            "gradients carry no graph, so a gradient penalty would silently contribute nothing. The recorder "
            "retired (later calls run eagerly); run this step's forward eagerly (with recorder.paused(): ...)"
        )

    def _on_hold_end(self, call: int, reason: str) -> None:
        self._pending_plan = None
        self.journal.tick("hold_end", call, reason)
        if self._free_after_backward and reason == "dropped":
            self._free_recordings()

    # ----------------------------------------------------------------- retirement
    def _retire(self, reason: str, call: int, cause: BaseException | None = None) -> None:
        self.lifecycle.retire(reason, call, cause)

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

    def retire(self, reason: str = "retired by the user") -> None:
        """Switch to eager for good: graphs and static memory are freed; training goes on eagerly."""
        self.lifecycle.retire(reason, self._calls, user=True)

    def release(self) -> None:
        """Restore ``module.forward`` and free everything; safe to call twice. Not a retirement."""
        self._hold.clear()
        if not self.lifecycle.release(self._calls):
            return
        if self._pool is not None:
            self._pool.leave(self)
        module = self.module
        assert module is not None
        if self._own_forward:
            module.forward = self._forward
        else:
            module.__dict__.pop("forward", None)
        module.__dict__.pop(_RECORDER_ATTR, None)
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
    """Put ``leaves`` where ``originals`` sit in the tree's ``_parameters`` dicts, and back.

    Each dict is visited once (``modules()`` yields a shared submodule once), so a module
    registered under two names (ALBERT's repeated block) is restored, which
    ``torch.nn.utils.stateless`` is not: its per-name swap records the stand-in as the
    second name's original. Tied parameters get the same leaf. Plain ``dict`` writes:
    the swap is not a change of the module the guards should see.
    """
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
        with flat_weights_follow(module):  # an RNN's weight cache follows (replaykit/recurrent.py)
            yield
    finally:
        for d, k, v in entries:
            dict.__setitem__(d, k, v)


def _reentry_reason(plan: _Plan) -> tuple[str, str]:
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


def recorder_of(module: nn.Module) -> Recorder | None:
    """The live recorder of a captured module, or None."""
    return module.__dict__.get(_RECORDER_ATTR)


def capture(
    module: nn.Module,
    *,
    backend: str = "auto",
    warmup: int = 3,
    max_recordings: int = 8,
    strict: bool = False,
    check_every: int = 0,
    multi_backward: bool = False,
    max_rerecords: int = 8,
    unsafe_disable: tuple[str, ...] | list[str] | str = (),
    pool: MemoryPool | None = None,
) -> Recorder:
    """Route every call of ``module`` through a recorder: record, replay, or eager with a reason.

    - A call in training mode with grad enabled and no replay backward pending records
      its signature (shapes, dtypes, strides, devices, requires_grad, non-tensor
      arguments, autocast state) while ``max_recordings`` lasts, then replays it.
    - Host-side values the forward reads are guarded (:mod:`replaykit.guards.module`): every
      submodule's ``training`` flag and plain attributes (``dropout.p``, ``momentum``, a
      float schedule) are part of the key, so a change records anew; parameters swapped
      for other tensors (``torch.func.functional_call``) route eager.
    - Otherwise it runs eagerly, with the reason in the journal: ``no_grad``, ``eval``,
      ``hold``, ``budget``, ``unhashable_argument``, ``object_argument``,
      ``parameters_swapped``, ``input_reused``, ``thread``, ``paused``, ``retired``.
    - Replays end bitwise equal to eager training: live gradients and outputs are
      copied out before each replay, the hold keeps a pending backward's activations,
      and parameters behind unread outputs keep ``.grad is None``.
    - A parameter, buffer or submodule registered anew, storage changed (``.to()``,
      ``load_state_dict(..., assign=True)``) or a frozen layer unfrozen drops the
      recordings and records anew (``rerecord`` in the journal, at most ``max_rerecords``
      times). New submodule hooks, a forward with side effects a replay cannot repeat
      (:mod:`replaykit.verify.probe`) or a failing capture retire the recorder (permanent eager,
      graphs freed, one warning).
    - What cannot be replayed exactly raises :class:`ReplayError` rather than give a
      wrong number: ``create_graph=True`` through a replayed call, a second backward
      through a call whose first backward replayed the graph (pass
      ``multi_backward=True`` to run every backward exactly through the recorded graph).

    ``backend`` is ``"cuda"``, ``"emulated"`` or ``"auto"`` (cuda for a module on a CUDA
    device). ``strict=True`` raises :class:`ReplayError` instead of any eager route or
    retirement. ``check_every=N`` compares every N-th replayed call with eager on the
    same state and retires with reason ``diverged: ...`` on any difference
    (:mod:`replaykit.verify.shadow`). ``pool=rk.MemoryPool()`` records into a pool shared with other
    entry points (:mod:`replaykit.memory.pool`; a call while another holds live memory there runs
    eagerly, ``pool_busy``). ``unsafe_disable`` switches protections off, for
    diagnosis only. Capturing a module that is already captured, or one inside (or
    around) a captured module, raises :class:`ReplayError`.
    """
    if not isinstance(module, nn.Module):
        raise ReplayError(f"capture() takes an nn.Module, not {type(module).__name__}")
    check_count("warmup", warmup, 1)
    check_count("max_recordings", max_recordings, 1)
    check_count("max_rerecords", max_rerecords, 0)
    check_count("check_every", check_every, 0, "(0: off)")
    if recorder_of(module) is not None:
        raise ReplayError(
            f"{type(module).__name__} is already captured; call release() on its recorder first"
        )
    _refuse_nesting(module)
    refuse_cudagraphs(module, "capture")
    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        raise ReplayError(
            f"{type(module).__name__} has uninitialized (lazy) parameters or buffers ({lazy[0]}, ...): "
            "run one forward eagerly to materialize them, then capture"
        )
    disabled = disabled_protections(unsafe_disable, "capture")
    pool = check_pool(pool)
    chosen = resolve_backend(backend, module, pool)
    recorder = Recorder(
        module,
        chosen,
        warmup,
        max_recordings,
        bool(strict),
        disabled,
        check_every,
        bool(multi_backward),
        max_rerecords,
        pool,
    )
    _live[id(recorder)] = weakref.ref(recorder)
    weakref.finalize(recorder, _live.pop, id(recorder), None)
    return recorder


#: Live recorders, weakly: to refuse capturing a module inside or around a captured one.
_live: dict[int, weakref.ref[Recorder]] = {}


def _refuse_nesting(module: nn.Module) -> None:
    """A captured module's forward runs inside the other's recording: two recorders would share one call."""
    for m in module.modules():
        if m is not module and recorder_of(m) is not None:
            raise ReplayError(
                f"{type(m).__name__} inside {type(module).__name__} is captured already; release it first"
            )
    for ref in list(_live.values()):
        other = ref()
        if (
            other is not None
            and other.module is not None
            and not other.released
            and tree_contains(other.module, module)
        ):
            raise ReplayError(
                f"{type(module).__name__} is inside {other.module_name}, which is captured; release that recorder first"
            )
