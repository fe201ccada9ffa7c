"""The whole step's recording call, as named steps: reference -> capture -> judge -> keep.

The call runs the step's Python more than once (the eager reference, whose end state the
recording must match, then the capture; a retry after a learnt input read runs both again) and
must end in exactly the state one eager call leaves: one
:class:`~replaykit.verify.call_state.CallState`, taken at its start, puts everything back, and
only the standing run's output is emitted. Each step returns None (go on) or an
:class:`Outcome` that :meth:`RecordingSteps._record_call` settles: ``stands`` (a run's work is
the call's), ``eager`` (put back, the twin's body runs once) or ``retry`` (put back, record
again). A mixin of :class:`~replaykit.step.TrainStep`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends import Region, Scratch, capture_failure, known_cause, refused_host_copy
from .backends.host_feeds import FeedSpecs
from .guards.code import ForwardInputs, LossInputs, cpu_versions, iterator_reason
from .guards.compiled import CompileWatch, compiled_regions, unwatched_compiled_code
from .guards.host_choices import Watch
from .guards.input_reads import NewInputRead, Provenance
from .guards.module import host_dependence
from .guards.optimizer import GRAD, host_state, tensors_of
from .memory.attribute_outputs import Assignment
from .memory.foreign import ForeignBuffers
from .memory.layout import aligned_copy
from .memory.write_back import WriteBack
from .step_effects import Learning, RunEffects, Wrote
from .verify.call_state import CallState
from .verify.contexts import recording as recording_context
from .verify.output import HeldOutput
from .verify.side_effects import SideEffects
from .verify.step_check import difference, end_state

__all__ = ["Outcome", "RecordingSteps", "StepRecording"]


class StepRecording:
    """One phase of one signature: its region, static inputs and loss, and the gradients it leaves."""

    __slots__ = ("after", "assignment", "back", "foreign", "grads_out", "handed", "keep", "loss")
    __slots__ += ("region", "static_inputs", "tail", "written")

    def __init__(
        self,
        region: Region,
        static_inputs: list[torch.Tensor],
        loss: torch.Tensor,
        grads_out: list,
        keep: list,
        foreign: ForeignBuffers | None = None,
        tail: bool = False,
        back: WriteBack | None = None,
    ) -> None:
        self.region = region
        # the optimizer step left out (it cannot be captured): run eagerly after each replay
        self.tail = tail
        self.back = back  # the inputs it writes in place, written back after a replay
        self.foreign = foreign  # a second network's gradient buffers (memory/foreign.py), or None
        self.static_inputs = static_inputs
        self.loss = loss
        self.grads_out = grads_out  # per parameter: the static gradient storage after it, or None
        self.keep = keep  # what the key names by id (incoming gradients, tensor hyperparameters): kept alive
        self.handed: list | None = None  # per buffer its hand-out (copy_out.py), at first use
        # a step phase that leaves a gradient (a parameter the optimizer does not step) or found
        # one: its replays set .grad as eager's step leaves it (None: the optimizer zeroed it)
        self.after = False
        # the tensors the step assigns to attributes, bound after each replay (attribute_outputs.py)
        self.assignment: Assignment | None = None
        self.written: dict[int, torch.Tensor | str] = {}


@dataclass
class Outcome:
    """How a recording call ends. ``stands``: ``loss`` is the call's (``run``'s output is
    emitted); ``eager``: the twin's body runs once from the state put back, journaled with
    ``reason`` (None: journaled already); ``retry``: record again (``rekey``: a read was learnt)."""

    kind: str
    loss: torch.Tensor | None = None
    run: HeldOutput | None = None
    reason: str | None = None
    rekey: bool = False


@dataclass
class Attempt:
    """One try at recording: its static inputs, region and what its steps hand on."""

    phase: str
    key: tuple
    callargs: Any
    args: tuple
    kwargs: dict
    static: list[torch.Tensor]
    region: Region
    reads: Provenance | None
    before: list[int]
    reference: list | None = None
    loss: torch.Tensor | None = None
    effects: SideEffects | None = None
    run: HeldOutput | None = None
    rec: Any = None
    private: list = field(default_factory=list)
    incoming: list = field(default_factory=list)  # the .grad tensors the call found
    foreign: ForeignBuffers | None = None
    choices: Watch | None = None
    moved: bool = False  # the reference moved the written inputs' versions (put back, not undone)
    feeds: FeedSpecs | None = None  # the host copies the reference made, fed by the capture
    assignment: Assignment | None = None  # the attribute outputs the capture repeats
    written: dict = field(default_factory=dict)  # what the capture assigned, by target


class RecordingSteps(RunEffects):
    """The recording call's steps, mixed into ``TrainStep`` (their state is the step's)."""

    # ----------------------------------------------------------------- the loop
    def _record_call(
        self, phase: str, key: tuple, callargs: Any, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        why = self._unrecordable()
        if why is not None:
            return self._retire_eager(why, phase, args, kwargs)
        if not self._recordings:
            self.lifecycle.first_record()
        self._forward_key = self._code()[1].key()  # its class attributes: changed by a run?
        self._hold_host_tensors()
        state = self._call_state()
        with state.watching(self.model):
            while True:
                outcome = self._attempt(state, phase, key, callargs, args, kwargs)
                if outcome.kind != "retry":
                    break
                state.restore()
                state.stands(None)
                if outcome.rekey:
                    key = self._choices.key(self._input_reads.rekey(callargs.tensors))
                    self._choices.rewind()
        if outcome.kind == "stands":
            state.stands(outcome.run)
            return outcome.loss
        state.restore()  # nothing of the recording call's runs stands: the twin's body runs once
        state.stands(None)
        return self._eager(phase, outcome.reason, args, kwargs)

    def _hold_host_tensors(self) -> None:
        """The CPU tensors the forward names beside a GPU model, with versions (:func:`cpu_versions`),
        before any run: read by ``_forward_changes``, so taken here and not on every call."""
        inputs = self._forward_inputs
        cpu = inputs is None or self.device.type == "cpu"
        self._host_held = [] if cpu else cpu_versions(inputs.held_tensors())

    def _attempt(
        self, state: CallState, phase: str, key: tuple, callargs: Any, args: tuple, kwargs: dict
    ) -> Outcome:
        """One try: reference -> capture -> judge -> keep; the first step to decide ends it."""
        a = self._prepare(phase, key, callargs, args, kwargs)
        outcome = self._reference(a, state) if self.on.verify_recording else None
        if outcome is None:
            outcome = self._capture(a, state)
        if outcome is None:
            outcome = self._judge(a, state)
        return outcome if outcome is not None else self._keep(a)

    def _unrecordable(self) -> str | None:
        """What no recording of this step can hold (checked before any run): a retirement."""
        frozen = host_dependence(self.model)
        if frozen is None and self._tail.eager is None:
            frozen = host_state(self.optimizer, self.device)
        if frozen is not None:
            return frozen
        if self.on.call_state:
            held = [name for code in self._code() for name in code.iterators()]
            if held:
                return iterator_reason("the step", held[0])
        if self.backend.name == "emulated" and self.on.compiled_code:
            regions = compiled_regions(self.model)  # the tape cannot see their kernels
            if regions:
                return CompileWatch.unseen_reason(regions[0][0])
            unwatched = unwatched_compiled_code()
            if unwatched is not None:
                return unwatched
        return None

    def _call_state(self, tensors: bool | None = None) -> CallState:
        """Everything the call's runs may change, taken before the first (``call_state`` off, unsafe:
        the tensor snapshot alone). ``tensors``: whether the runs execute kernels."""
        assert self.backend is not None
        if tensors is None:
            # a CUDA capture executes no kernels: without the reference only Python runs twice
            tensors = self.backend.name != "cuda" or self.on.verify_recording
        snapshot = self._snapshot(tensors=tensors)
        if not self.on.call_state:  # the code still says where private host generators live
            return CallState(snapshot, self.model, code=self._code(), whole=False)
        return CallState(snapshot, self.model, self.optimizer, self._code(), [self.ema])

    def _code(self) -> list:
        """Where loss_fn's and the model's forward code keep Python values (found once): the
        loss_fn guard's own finder, or one of the call state's while that guard is switched off."""
        world = self.__dict__.get("_code_world")
        if world is None:
            loss = self._loss_inputs or LossInputs(self.loss_fn, self.model)
            forward = self._forward_inputs or ForwardInputs(self.model)
            world = self.__dict__["_code_world"] = [loss, forward]
        elif self._loss_inputs is not None:
            world[0] = self._loss_inputs
        return world

    def _prepare(self, phase: str, key: tuple, callargs: Any, args: tuple, kwargs: dict) -> Attempt:
        """Static copies of the batch (one per distinct tensor: ``step(x, x)`` keeps ``a is b``, as the
        key's aliasing says), private aliases of the incoming gradients (a handed-out alias given
        storage of its own later must not move what the recording reads), the region."""
        before = self._grads.counts()  # a recording adds holders of its own
        copies: dict[int, torch.Tensor] = {}
        static = [
            copies[id(t)] if id(t) in copies else copies.setdefault(id(t), aligned_copy(t))
            for t in callargs.tensors
        ]
        incoming = list(map(GRAD, self._trainable))
        private = self._grads.private(incoming)
        for p, g in zip(self._trainable, private, strict=True):
            p.grad = g
        region = self.backend.region(static)
        # input-derived host reads are answered with this call's values. The watch (a dispatch mode)
        # keeps one more activation alive at the backward's peak: it watches once a capture without
        # it failed (a host read fails a CUDA capture), or where a read would not fail (CPU, tape).
        watched = (
            self._watch_reads
            or self.backend.name != "cuda"
            or any(t.device.type == "cpu" for t in static)
        )
        drawn_to = self._input_reads.drawn_to  # not None: its key's host draws are made before it
        reads = (
            Provenance(static, self._input_reads.answers(), draws=drawn_to is not None)
            if watched
            else None
        )
        a = Attempt(phase, key, callargs, args, kwargs, static, region, reads, before)
        a.private, a.incoming = private, incoming
        return a

    # ----------------------------------------------------------------- reference
    def _reference(self, a: Attempt, state: CallState) -> Outcome | None:
        """The verification's eager half: the twin's body from the state before the call, its end
        state kept (host copies), everything put back.

        It runs before the capture, and the backend gives eager's cached temporaries back
        around it (``Backend.trim``): after the capture the recording's pool holds a step's
        worth of memory, and an eager step beside it doubled the peak. Once recordings exist it
        runs in their pool's free memory (``region.scratch``): what it leaves there frees them
        (:meth:`_left_in_pool`). Python the body runs for its effects shows here first: then
        this eager run is the call (it stands).
        """
        self.backend.trim()  # warm-up's cache (a side stream's blocks serve no other stream)
        scratch = (
            a.region.scratch()
            if self._recordings and self._in_pool and self._sole_user()
            else Scratch()
        )
        drawn_to = self._input_reads.drawn_to
        effects = self._effects(a, a.callargs.tensors)
        a.choices = self._choices.watch() if self.on.host_rng else None
        # host draws seen before, none known for this key: find them and their reads (this run only)
        learning = self._learn_draws and drawn_to is None and self.on.input_reads
        found = Provenance(a.callargs.tensors, discover=True, draws=True) if learning else None
        loose = self._loss_inputs.tensors() if self._loss_inputs is not None else ()
        held = [t for t in loose if not t.is_inference()]
        versions = [t._version for t in held]
        run = state.output()
        self._walking, self._foreign = self.on.foreign_grads, []
        reads = self._attribute_reads()
        try:
            found_or_not = found if found is not None else contextlib.nullcontext()
            choices = a.choices if a.choices is not None else contextlib.nullcontext()
            a.feeds = FeedSpecs() if self._feed_host else None
            feeds = a.feeds if a.feeds is not None else contextlib.nullcontext()
            watch = reads if reads.watched else contextlib.nullcontext()
            with effects, found_or_not, choices, scratch, run.held(), feeds, watch:
                eager = self._body(a.phase, a.args, a.kwargs)
        except BaseException:  # eager's exception: a cache it filled first stays in the pool
            self._unchecked = scratch
            state.stands(run)  # it printed what eager prints before raising
            raise
        finally:
            self._walking = False
        effects.also_changed(a.static)
        why = self._attribute_outputs(effects, reads, a.callargs.tensors)
        why = why or self._arguments_why(a.callargs, a.args, a.kwargs) or self._files_why(run)
        why = why or self._reference_why(effects, found, held, versions, state, a.choices)
        why = why or self._choices_why(a.choices)
        if why is not None:
            return self._reference_stands(a, why, eager, scratch, run)
        written = [*state.outside, *effects.named_written(), *self._attrs.values()]
        a.reference = end_state(*self._judged(), eager, clone=True, extra=written)
        state.restore()
        a.moved = effects.put_back(a.static)  # the batch as the call found it
        for p, g in zip(self._trainable, a.private, strict=True):
            p.grad = g  # what the capture reads (see _prepare)
        del eager
        self._left_in_pool(scratch)
        self.backend.trim()
        return None

    def _effects(self, a: Attempt, tensors: list[torch.Tensor]) -> SideEffects:
        """A watch over a run of the body on ``tensors`` (the batch or its static copies); an input
        it writes in place is written back to the caller's (``memory/write_back.py``)."""
        drawn = (self._input_reads.drawn_to, self._choices.drawn_to)
        return SideEffects(self.model, tensors, self.on.host_rng, *drawn, a.callargs.tensors)

    def _reference_stands(
        self, a: Attempt, why: str, eager: torch.Tensor, scratch: Scratch, run: HeldOutput
    ) -> Outcome:
        """The reference run is the call's work: what it hands back leaves the pool; retire, or
        journal what is learnt (:class:`Learning`: not a retirement)."""
        with torch.no_grad():
            for p in (*self._trainable, *self._foreign_leaves.leaves, *self._foreign):
                if p.grad is not None and scratch.owns(p.grad):
                    p.grad = p.grad.clone()
            eager = eager.clone() if scratch.owns(eager) else eager
        self._left_in_pool(scratch)
        a.region.free()
        if isinstance(why, Wrote):
            self._wrote(why)
        elif isinstance(why, Learning):
            self.journal.add("refuse", self._calls, why.reason, why)
        else:
            self._retire(why, self._calls)
        if a.phase in ("step", "last"):
            self._stepped()
        return Outcome("stands", eager, run)

    # ----------------------------------------------------------------- capture
    def _capture(self, a: Attempt, state: CallState) -> Outcome | None:
        """The recording: the body captured over the static inputs (on CUDA it then replays once:
        the call's step). Effects a replay would not repeat let this run stand, unkept."""
        a.effects = self._effects(a, a.static)
        a.choices = self._choices.watch(capture=True) if self.on.host_rng else None
        choices = a.choices if a.choices is not None else contextlib.nullcontext()
        watch = CompileWatch(self.backend.name == "emulated", self.on.compiled_code)
        a.run = state.output()
        self._walking, self._foreign = self.on.foreign_grads, []
        outside = self._foreign_buffers(a, state)
        a.assignment = self._attrs.outputs.assignment()
        # no reference ran (verification off): the capture's run learns what it assigns
        reads = self._attribute_reads() if a.reference is None else None
        try:
            branches = recording_context(self.on.capture_branches)
            learning = reads if reads is not None and reads.watched else contextlib.nullcontext()
            standing = self._stand_ins(a)
            with a.effects, branches, watch, choices, a.run.held(), learning, standing:
                (a.loss, *_) = a.region.capture(
                    lambda: self._assigning_body(a), None if a.feeds is None else a.feeds.specs
                )
            watch.check()
        except Exception as exc:
            a.region.abort()
            return self._capture_failed(a, exc, watch)
        except BaseException:  # KeyboardInterrupt: nothing of this call happened; record later
            a.region.abort()
            state.restore()
            state.stands(None)
            raise
        finally:
            self._walking = False
        if a.foreign is not None:
            a.foreign.captured()
        a.effects.also_changed(a.callargs.tensors)
        a.effects.exclude(self._attrs.outputs.targets())
        learnt = self._attribute_outputs(a.effects, reads, a.static)
        a.key = self._input_reads.settle(a.key, () if a.reads is None else a.reads.reads)
        a.rec = self._recorded(a)
        why = learnt or self._capture_why(a.effects, a.reads, a.choices, state, a.run)
        if why is None:
            return None
        # the body ran once, as eager's: its effects stand (an input's write too); no recording kept
        with torch.no_grad():
            for i in a.effects.written_inputs():
                a.callargs.tensors[i].copy_(a.static[i])
            for p in self._foreign_leaves.leaves:  # new ones made in the region's memory
                if p.grad is not None and p.grad is not outside.get(id(p), p.grad):
                    p.grad = p.grad.clone()
        out = self._after(a.phase, a.rec)
        a.region.free()
        if isinstance(why, Learning):
            self.journal.add("refuse", self._calls, why.reason, why)
        elif a.effects.writes_only():
            self._wrote(
                why
            )  # a write into the model (config.problem_type, a cache): it stands, as eager's
        else:
            self._retire(why, self._calls)
        return Outcome("stands", out, a.run)

    def _recorded(self, a: Attempt) -> StepRecording:
        """The capture's recording; an optimizer step left out of it runs now, as after a replay."""
        grads_out = [p.grad for p in self._trainable]  # per parameter: its storage after, or None
        keep = [*(g for g in a.private if g is not None), *tensors_of(self.optimizer)]
        keep += [] if a.reads is None else a.reads.staged  # host memory the graph copies from
        tail = self._tail.eager is not None and a.phase in ("step", "last")
        back = WriteBack.of(a.static, a.effects.version_moves()) if self.on.write_back else None
        rec = StepRecording(a.region, a.static, a.loss, grads_out, keep, a.foreign, tail, back)
        rec.assignment, rec.written = a.assignment, a.written
        rec.after = any(g is not None for g in (*grads_out, *a.incoming))
        if tail:
            self._eager_tail(rec)
        return rec

    def _wrote(self, why: str) -> None:
        """A run that wrote into the model stood as the call (``guards/fills.py``): the first write
        or a cache filled for a new state records later (a fill drops the recordings made for the
        old state: re-record); a write that recurs at consecutive calls retires."""
        call = self._calls
        verdict = self._fills.verdict(call)
        if verdict == "repeats":
            self._retire(why, call)
        elif verdict == "fill" and self.on.cache_fills:
            self.lifecycle.rerecord(f"cache_fill: {why}", call)
        else:
            self.journal.add(
                "refuse", call, "first_write" if verdict == "first_write" else "cache_fill", why
            )

    def _foreign_buffers(self, a: Attempt, state: CallState) -> dict[int, torch.Tensor | None]:
        """A second network's gradients learnt: static copies as its ``.grad`` for the capture.
        Returns the gradients of the parameters outside the model before it (by id)."""
        if self._foreign_leaves.leaves:
            a.foreign = ForeignBuffers(self._foreign_leaves.leaves)
            a.foreign.begin()
        return {id(p): p.grad for m in state.modules for p in m.parameters()}

    def _stand_ins(self, a: Attempt) -> contextlib.AbstractContextManager:
        """A second network's leaves stood in for during the capture (``memory/foreign.py``)."""
        if a.foreign is None:
            return contextlib.nullcontext()
        return self._foreign_leaves.standing_in()

    def _assigning_body(self, a: Attempt) -> list[torch.Tensor]:
        """The captured body; with attribute outputs learnt, the tensors it assigned are outputs too."""
        if a.assignment is None:
            return self._captured_body(a)
        out, a.written = self._attrs.body(a.assignment, self._captured_body, a)
        return out

    def _captured_body(self, a: Attempt) -> list[torch.Tensor]:
        args, kwargs = a.callargs.rebuild(a.static)
        if a.reads is None:
            return [self._body(a.phase, args, kwargs)]
        with a.reads:
            return [self._body(a.phase, args, kwargs)]

    def _capture_failed(self, a: Attempt, exc: Exception, watch: CompileWatch) -> Outcome:
        """A capture that raised: learn a read and retry, watch reads and retry, or run eagerly."""
        call = self._calls
        if self._tail_failed:  # the optimizer step: the next call records without it
            self._tail_failed = False
            why = self._tail.failed(exc)
            self.lifecycle.rerecord(f"optimizer_eager: {why}", call)
            return Outcome("eager", reason=self.lifecycle.stopped() or "optimizer_eager")
        if refused_host_copy(exc) and not self._feed_host:
            self._feed_host = True  # host data moved to the GPU: fed before each replay
            self.journal.add(
                "refuse", call, "host_feeds", "a host-to-device copy: captured again, fed"
            )
            return Outcome("retry")
        if isinstance(exc, NewInputRead) and self._input_reads.learn(exc.program):
            # a function of the batch alone: evaluated before choosing a recording from now on
            self.journal.add(
                "refuse", call, "input_read", "an input-derived host read: keyed from now on"
            )
            return Outcome("retry", rekey=True)
        if watch.recompiled():  # this call runs eagerly (compiling it); the next records
            return Outcome("eager", reason="compiling")
        # perhaps a host read of the batch: captured again, watched (a known cause's error is the reason)
        if a.reads is None and known_cause(exc) is None:
            self._watch_reads = True
            self.journal.add(
                "refuse",
                call,
                "input_read",
                f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): "
                "again, watching input-derived host reads",
            )
            return Outcome("retry")
        self._retire(capture_failure(exc), call)
        return Outcome("eager", reason=self.lifecycle.stopped() or "retired")

    # ----------------------------------------------------------------- judge and keep
    def _judge(self, a: Attempt, state: CallState) -> Outcome | None:
        """The recording's end state against the reference's, bit for bit (the modules loss_fn
        holds included): a difference refuses the signature, and the twin's body runs once."""
        if a.reference is None:
            return None
        written = [*state.outside, *a.effects.named_written(), *self._attrs.values()]
        now = end_state(*self._judged(), a.loss, clone=False, extra=written)
        found = difference(now, a.reference)
        self.journal.add("check", self._calls, "recording", found)
        if found is None:
            return None
        a.region.free()
        self._refused[a.key] = "diverged"
        self.journal.add(
            "refuse", self._calls, "diverged", f"the recording differs from eager: {found}"
        )
        return Outcome("eager")  # journaled: the refusal says why

    def _keep(self, a: Attempt) -> Outcome:
        """The recording stands: kept under its key; its gradients are left as eager leaves them."""
        new = self.new_part(a.key, self._recordings)
        self._recordings[a.key] = a.rec
        if a.rec.back is not None:  # the recording call's step wrote the static inputs
            a.rec.back.copy_back(a.callargs.tensors, bump=not a.moved)
        new = f" (new {new})" if new else ""
        self.journal.add("record", self._calls, a.phase, f"recording {len(self._recordings)}{new}")
        self._grads.rebase(a.before)
        for p, g in zip(self._trainable, a.incoming, strict=True):
            if g is not None and (now := p.grad) is not None and now.data_ptr() == g.data_ptr():
                p.grad = g  # accumulated into in place, as eager's: the tensor the call found
        return Outcome("stands", self._after(a.phase, a.rec), a.run)

    def _judged(self) -> tuple:
        """What end_state reads of the step."""
        graded = [*self._trainable, *self._foreign_leaves.leaves]
        return (self.model, self.optimizer, self.scaler, self.ema, graded)

    def _sole_user(self) -> bool:
        """A shared pool's other users' recordings would need freeing too: their reference runs beside it."""
        return self._pool is None or self._pool.sole(self)

    def _left_in_pool(self, scratch: Scratch) -> None:
        """The reference run left tensors in the pool: the earlier recordings, whose replays may
        write there, are freed (recorded again at their next call), and references run beside
        the pool from now on (no more freeing)."""
        left = scratch.survivors()
        if not left or not self.on.pool_survivors:
            return
        for rec in self._recordings.values():
            rec.region.free()
        self._in_pool = False
        self.journal.add(
            "refuse",
            self._calls,
            "pool_survivors",
            f"the recording call's reference step left {left} bytes in the pool: "
            f"{len(self._recordings)} earlier recording(s) freed, recorded again at their next call",
        )
        self._recordings.clear()
