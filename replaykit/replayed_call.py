"""The replayed call: one ``autograd.Function`` whose forward and backward replay a recording.

What a kept recording's replays read (:class:`Plan`), and the recorder's side of a replayed
forward and backward: copy-out, the hold, the saved-tensor version checks, the None pattern,
the shadow check. A mixin of :class:`~replaykit.recorder.Recorder`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from .backends import Recording
from .errors import ReplayError
from .guards.grad_hooks import chained
from .guards.signature import CallArgs
from .memory.attribute_outputs import Assignment
from .memory.copy_out import StaticAliases
from .memory.hold import PendingBackward
from .memory.layout import copy_into
from .memory.write_back import WriteBack
from .verify.shadow import Shadow

__all__ = ["Plan", "RecorderReplay"]

_VERSION = operator.attrgetter("_version")
_detach = torch.Tensor.detach


class _Replay(torch.autograd.Function):
    """Connects one replayed call to autograd: forward replays, backward replays its backward."""

    @staticmethod
    def forward(ctx: Any, step: _Step, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.step = step
        # the inputs come first, then the parameters
        return step.recorder._forward_replay(ctx, step, tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        step: _Step = ctx.step
        # autograd runs a backward without create_graph in no-grad mode
        if not torch.is_grad_enabled():
            return (None, *step.recorder._backward_replay(step, grads))
        if step.recorder.on.repeat_backward:
            # create_graph=True: replayed gradients carry no graph
            step.recorder._refuse_double_backward(step)
        with torch.no_grad():
            return (None, *step.recorder._backward_replay(step, grads))


#: autograd's C entry point for _Replay: what Function.apply calls after its Python pass over the arguments
_apply_c = super(torch.autograd.Function, _Replay).apply
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _apply(
    step: _Step, inputs: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """``_Replay.apply(step, *inputs, *params)`` without ``Function.apply``'s pass over every
    argument. That pass unwraps dead functorch wrappers (~150 ns per parameter); the inputs are
    unwrapped here as it does, and the parameters are the recording's own, never wrappers. Inside a
    transform the ordinary path runs."""
    if _functorch_active():
        return _Replay.apply(step, *inputs, *params)
    return _apply_c(step, *map(_unwrap_if_dead, inputs), *params)


class Plan:
    """One recording and what replaying it needs, gathered when it is recorded: a call looks nothing up by key."""

    __slots__ = (
        "aliases",
        "all_differentiable",
        "assignment",
        "autocast",
        "back",
        "cleared",
        "copies",
        "generators",
        "grad_order",
        "inputs_written",
        "key",
        "multi_use",
        "recording",
        "refresh",
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
        foreign: Sequence[torch.Tensor] = (),
    ) -> None:
        # parameters read more than once per call (their gradient is a sum inside it)
        self.multi_use: list[str] = []
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
        # the inputs it writes in place (the shadow compares them)
        self.inputs_written: tuple[int, ...] = ()
        self.back: WriteBack | None = None  # their copy back to the caller after each replay
        # tensors the forward assigns to attributes: among the outputs, assigned after each replay
        self.assignment: Assignment | None = None
        # where two or more parameters carry gradient hooks: eager's order, kept by a chain
        self.grad_order: list[int] = []
        # the module's generators it registered, kept alive: while it is, no generator assigned
        # anew takes one's id, so the module guard's key tells them apart (records anew)
        self.generators: list[torch.Generator] = []
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
        # the static inputs the backward reads, written again from the caller's tensors before each
        # backward: (index into the step's saved inputs, its .data or None, the static), one per static
        self.refresh: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        for k, i in enumerate(saved_inputs):
            static = recording.static_inputs[i]
            if all(static is not other for _, _, other in self.refresh):
                data = next(d for _, d, other in self.copies if other is static)
                self.refresh.append((k, data, static))
        # after the .data aliases: their references are part of the use-count baseline (an output
        # that is a view of an input, possible with record_probe off, shares a static input's storage)
        self.aliases = StaticAliases(
            recording.static_outputs if guard_outputs else (),
            [*recording.static_inputs, *foreign],
        )

    def free(self) -> None:
        """Let static memory go with the recording: a replayed call's autograd node (its step) may outlive it."""
        self.copies = []
        self.refresh = []
        self.back = None
        self.aliases = StaticAliases(())


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

    def __init__(self, recorder: RecorderReplay, plan: Plan, call: int) -> None:
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


class RecorderReplay:
    """The replayed call's side of a :class:`~replaykit.recorder.Recorder` (a mixin: the recorder's state)."""

    def _guard_new_grads(self, plan: Plan) -> None:
        """Put static gradient buffers a recording has (now) under copy-out."""
        if not self.on.copy_out:
            return
        recording = plan.recording
        params = recording.params
        grads = recording.static_grads[len(recording.static_grads) - len(params) :]
        kept = [i for i, g in enumerate(grads) if g is not None]
        recording.handed_grads = plan.aliases.add_grads(
            [(params[i], grads[i]) for i in kept],  # type: ignore[misc]
            [i - len(params) for i in kept],  # their places among the recording's, from the end
            recording.static_grads,
        )

    def _replay(
        self,
        call: int,
        plan: Plan,
        callargs: CallArgs,
        args: tuple,
        kwargs: dict,
        shadow: Shadow | None = None,
    ) -> Any:
        recording = plan.recording
        step = _Step(self, plan, call)
        self._replayed_calls += 1
        verifying = self.on.verify_recording and not plan.verified
        if plan.assignment is not None:  # the states the forward reads, into its slots
            plan.assignment.feed()
        if shadow is not None:  # the recording call's, made before the recording
            step.shadow = shadow
        elif verifying or (self.check_every and (self._replayed_calls - 1) % self.check_every == 0):
            self._choices.rewind()  # eager's forward, the replay is checked against, draws itself
            run = partial(self._run_forward, callargs, recording.params)
            step.shadow = Shadow(
                self.module,
                run if plan.assignment is None else plan.assignment.wrap(run),
                callargs.tensors,
                recording.params,
                plan.written,
                self._shadow_held(),
                plan.inputs_written,
                self.on.data_rebind,
            )
        params = recording.params
        if plan.grad_order:  # hooks run as eager's backward reaches each parameter
            params = chained(params, plan.grad_order)
        outputs = _apply(step, callargs.tensors, params)
        self._choices.advance()  # Python's and numpy's generators where eager's draws leave them
        self._input_reads.advance()  # torch's CPU generator (the key's host draws) too
        result = recording.build_outputs(outputs)
        if plan.assignment is not None:  # before the check: eager's forward assigned them too
            result = plan.assignment.assign(result, self.on.attribute_outputs)
        shadow = step.shadow
        if shadow is not None:
            written = callargs.tensors if plan.inputs_written else ()
            difference = shadow.check_forward(self.module, outputs, recording.out_spec, written)
            self.journal.add("check", call, "forward", difference)
            if difference is not None:
                del outputs, step  # the hold ends with the discarded graph
                shadow.snapshot.restore()  # the state before this call: eager runs it again
                shadow.put_back(callargs.tensors)  # its inputs too, where the replay wrote them
                self._diverged(plan, difference, call, verifying)
                return self._call_forward(*args, **kwargs)
        plan.aliases.handed_out(outputs)
        return result

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

    def _give_away(self, call: int) -> str | None:
        """After a copy-out that left aliases: None when they were given away (no recording is
        left: the call records anew), else the call's eager reason (``live_alias``, or
        ``retired`` where that re-record spent the budget).

        Without the storage swap a ``.grad`` on a static buffer that a view or ``.data`` also
        holds cannot move (``copy_out.py``): it becomes the caller's for good, and every recording
        that could write its memory is dropped (a re-record: each recording of this recorder, as
        graphs sharing a pool reuse each other's freed blocks; the held block stays allocated, so
        no new capture lands on it). AccumulateGrad adds into an existing ``.grad`` in place and
        never adopts a buffer again, so the calls after the new recording replay. Not where
        another entry point shares the pool (its graphs may use that memory too), nor while a
        replayed call's backward is pending (it reads the recordings)."""
        if self._hold.active or (self._pool is not None and not self._pool.sole(self)):
            return "live_alias"
        held = [a.given_away() for a in self._aliases.values() if a.dirty]
        if not held or not all(held):
            return "live_alias"
        self.lifecycle.rerecord(
            "grads_given_away",
            call,
            f"{sum(held)} gradient buffer(s) held beside .grad (a view, .data) that this torch "
            "cannot move: left with the caller, every recording dropped and recorded anew",
        )
        return "retired" if self.lifecycle.retired else None

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
        if plan.back is not None:  # before the versions below: the write is the forward's
            plan.back.copy_back(tensors)
        # what eager's saved-tensor check covers: the parameters the backward reads
        if self.on.inplace_weights:
            step.versions = list(map(_VERSION, plan.saved))
        if plan.saved_inputs:  # and the caller's inputs it reads
            step.inputs = [(tensors[i], tensors[i]._version) for i in plan.saved_inputs]
        self._replays += 1
        step.generation = self._replays
        if self.on.hold:
            # ctx (and so step) lives exactly as long as the pending autograd graph
            step.pending = self._hold.begin(step.call)
            self._pending_plan = plan
        # what the caller may keep: views on storages of their own (copy_out.py), or the static outputs
        outputs = tuple(map(_detach, plan.aliases.hand_out() or recording.static_outputs))
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
        if step.inputs is not None:
            self._saved_inputs(step)
        wanted = (
            grads
            if plan.all_differentiable and self.on.none_pattern
            else self._incoming(recording, grads)
        )
        step.backwards += 1
        if step.backwards > 1 and self.on.repeat_backward:
            result, how = recording.exact_backward(wanted), "repeat"
        elif self.multi_backward:
            result, how = recording.exact_backward(wanted), "multi_backward"
        else:
            # a backward graph was captured: its buffers join copy-out
            if recording.prepare_backward(wanted):
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
            if how is None and recording.handed_grads is not None:  # views of memory freed below
                result = [None if g is None else g.clone() for g in result]
            self._free_recordings()
        return result

    def _end_hold(self, step: _Step) -> None:
        if step.pending is not None:
            if self._hold.release(step.pending):
                self._on_hold_end(step.call, "backward")
            step.pending = None

    def _saved_inputs(self, step: _Step) -> None:
        """The inputs the backward reads, as eager's saved tensors hold them now: a write that moved
        a version raises (as eager does); any other (a numpy buffer refilled, a write through
        ``.data``) is copied into the static input, which the backward graph reads, before it runs."""
        inputs = step.inputs
        assert inputs is not None
        if self.on.input_versions and any(t._version != v for t, v in inputs):
            raise ReplayError(
                "replaykit: one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: an input of {self.module_name} changed between replayed call {step.call} and its "
                "backward (eager raises here too)"
            )
        if self.on.input_rewrites:  # on the current stream, before the backward graph's replay
            for k, data, static in step.plan.refresh:
                if data is not None:
                    data.copy_(inputs[k][0])
                else:
                    copy_into(static, inputs[k][0])

    def _check_activations(self, step: _Step) -> None:
        """A backward may read this call's activations only if no later replay overwrote them."""
        if not step.recording.static_inputs:
            raise ReplayError("replaykit: the recording was freed before this backward ran")
        overwritten = self._replays != step.generation
        if overwritten and (self.on.hold or step.backwards):
            raise ReplayError(
                f"replaykit: backward of call {step.call} after a later replay overwrote its activations "
                "(a retained graph differentiated across replays)"
            )
        if step.backwards and self.on.repeat_backward and not step.exact:
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
        if self.on.none_pattern:
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
        current: list[tuple[int, torch.Tensor]] = []
        if step.inputs is not None and self.on.input_rewrites:
            current = [
                (i, t) for i, (t, _) in zip(step.plan.saved_inputs, step.inputs, strict=True)
            ]
        reference, difference = shadow.reference_grads(
            self.module, recording.differentiable, wanted, current
        )
        # nothing compared: a recording not verified yet is checked at its next replay
        if reference is None:
            return result
        needs = recording.inputs_requiring_grad
        ref = iter(reference)
        full = [next(ref) if req else None for req in needs] + list(ref)
        names = [f"input {i} grad" for i in range(len(needs))] + [
            f"grad {n}" for n in self._param_names(recording)
        ]
        if difference is None:
            difference = shadow.check_backward(names, full, result)
        else:  # eager has no one answer to hand back: the replay's gradients stand for this call,
            # as tensors of their own (the recording they view is dropped below)
            full = [None if g is None else g.clone() for g in result]
        self.journal.add("check", step.call, "backward", difference)
        if difference is None:
            step.plan.verified = True
            return result
        self._diverged(
            step.plan, difference, step.call, self.on.verify_recording and not step.plan.verified
        )
        return full

    def _diverged(self, plan: Plan, difference: str, call: int, verifying: bool) -> None:
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
