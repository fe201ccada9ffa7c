"""Network replay's recording call, as named steps: refuse early -> probe -> reference -> capture -> judge.

The call runs the forward more than once (probe, the shadow's eager forward, warm-up, capture),
then replays or runs eagerly; either way the module is left as one eager call leaves it: one
:class:`~replaykit.verify.call_state.CallState` taken before the first run is restored after the
last. Prints and log records are held: a recording that replays this call emits the probe's; a
call that runs eagerly emits its own. A mixin of :class:`~replaykit.recorder.Recorder`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .backends import Recording, Subject, capture_failure, refused_host_copy
from .guards.code import cpu_versions, iterator_reason
from .guards.compiled import (
    CompileWatch,
    aot_compiled,
    compiled_regions,
    unwatched_compiled_code,
)
from .guards.host_choices import Watch
from .guards.input_reads import Provenance
from .guards.module import host_dependence
from .guards.recurrent import records_cudnn_dropout
from .guards.signature import CallArgs
from .memory.attribute_outputs import Assignment
from .memory.outputs import OutputTree
from .verify import weight_caches
from .verify.call_state import CallState
from .verify.contexts import recording as recording_context
from .verify.output import HeldOutput
from .verify.probe import Findings, Refusal, probe
from .verify.shadow import Shadow
from .verify.snapshot import StateSnapshot

__all__ = ["Made", "RecorderRecording"]


@dataclass
class Made(Findings):
    """What the recording call's runs found (the probe's :class:`Findings`, ``saved``: all the
    parameters unless the probe says) and made, for the plan of a kept recording."""

    key: tuple
    static_inputs: list[torch.Tensor]
    named: list[tuple[str, torch.Tensor]]
    # tensors the forward assigns to attributes, recorded as outputs (memory/attribute_outputs.py)
    assignment: Assignment | None = None
    refusal: Refusal | None = None
    shadow: Shadow | None = None
    recording: Recording | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for _, p in self.named]


def _files_refusal(run: HeldOutput) -> Refusal | None:
    """The probe's forward opened a file for writing: a replay runs no Python. It retires (the
    call's eager run writes it again: a write cannot be taken back)."""
    if not run.written_files:
        return None
    return Refusal(
        "module", f"the forward opens {run.written_files[0]!r} for writing: a replay would not"
    )


_HOST_WRITE = (
    "the forward writes a CPU tensor it names (a global, a cell) beside a GPU module: a CUDA graph "
    "would not replay that host op"
)


class RecorderRecording:
    """The recording call's steps, mixed into ``Recorder``."""

    def _record_call(self, call: int, callargs: CallArgs, key: tuple) -> Made | None:
        """Record ``callargs``' signature; None: not recorded (``_not_recorded`` says the eager route)."""
        self._not_recorded = "retired"  # the eager route's reason when this returns None
        if not self._recordings:
            self.lifecycle.first_record()
        why = self._unrecordable()
        if why is not None:
            self._retire(why, call)
            return None
        if call == 1 and records_cudnn_dropout(self.module):
            # cuDNN seeds its dropout state from the CUDA generator at the first dropout forward
            # after a seed: that draw is one eager call's (a recording call's extra run would
            # draw it and the state put back would not draw it again)
            self._not_recorded = "cudnn_dropout_seed"
            return None
        state = self._call_state()
        static = self._static_inputs(callargs.tensors)
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        made = Made(key, static, named, saved=list(range(len(named))))
        host = self._host_held()
        try:
            with state.watching(self.module):
                runs = self._runs(made, callargs, state)
            written = any(t._version != v for t, v in host)
        finally:
            state.restore()  # the replay or the eager run that follows is the call's one run
        if runs and written:
            self._retire(_HOST_WRITE, call)
            runs = False
        made = self._judge(made, call) if runs else None
        # a recording that replays this call emits the probe's output; an eager call prints its own
        kept = made is not None and self._clears(made)
        state.stands(next((r for r in state.runs if r.items), None) if kept else None)
        return made

    def _unrecordable(self) -> str | None:
        """What no recording of this module can hold (checked before any run): a retirement."""
        if self.lifecycle.watch.hooks_at_start:
            return "module hooks inside the module would not run under replay"
        frozen = host_dependence(self.module)
        if frozen is not None:  # refused on both backends: the emulated one mirrors a graph
            return frozen
        if self.on.call_state and self._forward_inputs is not None:
            held = self._forward_inputs.iterators()
            if held:
                return iterator_reason("forward", held[0])
        if self.backend.name == "emulated" and self.on.compiled_code:
            # refused before the probe runs compiled code the tape cannot see (compiled.py)
            regions = compiled_regions(self.module)
            if regions:
                return CompileWatch.unseen_reason(regions[0][0])
            unwatched = unwatched_compiled_code()
            if unwatched is not None:
                return unwatched
        compiled = aot_compiled(self.module)
        if compiled is not None:
            # measured on the H200: a recording's backward runs inductor's compiled backward again
            # (the exact and verified backwards), which raises for the buffers it donates
            return (
                f"{compiled} is torch.compile'd: its compiled backward donates its buffers, which network "
                "replay's backward cannot run again; use rk.TrainStep over the compiled model (it replays it)"
            )
        return None

    def _call_state(self) -> CallState:
        """Everything the call's runs may change, taken before the first (without ``call_state``,
        unsafe: the module's values alone)."""
        snapshot = StateSnapshot(self.module, rebinds=self.on.data_rebind)
        if not self.on.call_state:  # the code still says where private host generators live
            return CallState(snapshot, self.module, code=[self._forward_inputs], whole=False)
        return CallState(snapshot, self.module, code=[self._forward_inputs])

    def _forward_held(self) -> list[torch.Tensor]:
        """Tensors the forward names through globals and cells (a total it adds to in place): an
        eager check's runs put them back, as the call state does (the replay writes them once)."""
        inputs = self._forward_inputs
        return inputs.held_tensors() if inputs is not None and self.on.call_state else []

    def _shadow_held(self) -> list[torch.Tensor]:
        """What an eager rerun of the forward (the shadow check's) puts back besides the module's
        state: the forward's held tensors and cuDNN's RNN dropout state, which it advances."""
        return [*self._forward_held(), *self._dropout_buffers]

    def _host_held(self) -> list[tuple[torch.Tensor, int]]:
        """The CPU tensors the forward names beside a GPU module, with versions (:func:`cpu_versions`)."""
        return [] if self._device_kind == "cpu" else cpu_versions(self._forward_held())

    def _runs(self, made: Made, callargs: CallArgs, state: CallState) -> bool:
        """Probe, reference, capture (each run's output held); False: the recording call failed
        (retired, or the call compiles: ``_not_recorded`` says which)."""
        fn = self._forward_of(made, callargs)
        # draws from torch's CPU generator seen before (beside a GPU model): the probe finds them
        reads = Provenance(made.static_inputs, discover=True, draws=self._learn_draws)
        watch = CompileWatch(self.backend.name == "emulated", self.on.compiled_code)
        draws = self._choices.watch() if self.on.host_rng and self.on.record_probe else None
        try:
            before = self._forward_inputs.key() if self._forward_inputs is not None else ()
            with state.output().held() as run, draws or contextlib.nullcontext():
                made.refusal = self._probe(made, reads.wrap(fn), callargs.tensors)
                made.refusal = made.refusal or self._class_writes(before)
            made.refusal = made.refusal or self._eager_only(run) or self._learn_attributes(made)
            made.refusal = self._private_draws(state) or self._draws_refusal(made.refusal, draws)
            made.refusal = self._cpu_draws_refusal(made.refusal, reads)
            settled = self._input_reads.settle(made.key, reads.reads)
            made.key = settled if settled is made.key else self._choices.rekey(settled)
            self._dropout_buffers = state.dropout_buffers() or self._dropout_buffers
            if made.refusal is not None:
                return True
            with state.output().held():
                made.shadow = self._reference(made, callargs, state)
            # the recording is answered the values the probe read: no sync inside it
            answered = None
            if reads.reads:  # and the key's host draws' reads (made before this call)
                drawn = self._input_reads.drawn_to is not None
                answered = Provenance(made.static_inputs, dict(reads.reads), draws=drawn)
                fn = answered.wrap(fn)
            branches = recording_context(self.on.capture_branches)
            cached = weight_caches.uncached() if self.on.call_state else contextlib.nullcontext()
            runs: list[Watch] = []  # warm-up's and the capture's draws: the keyed choices, moved
            if self.on.host_rng:
                fn = self._choices.watched(fn, runs)
            with branches, watch, cached, state.output().held():
                made.recording = self.backend.record(
                    Subject(
                        fn,
                        made.static_inputs,
                        made.params,
                        self.warmup,
                        (*made.generators,),
                        self._feed_host,
                    )
                )
            if answered is not None:
                made.recording.host_memory = answered.staged  # the graph copies from it
            watch.check()
            self._recorded_draws(made, runs, state)
        except Exception as exc:
            if watch.recompiled():  # this call runs eagerly (compiling it); the next records
                self._not_recorded = "compiling"
                return False
            if refused_host_copy(exc) and not self._feed_host:
                self._feed_host = True  # host data moved to the GPU: the next call records, fed
                self._not_recorded = "host_feeds"
                return False
            self._retire(capture_failure(exc), self._calls, cause=exc)
            return False
        return True

    def _forward_of(self, made: Made, callargs: CallArgs) -> Any:
        """The forward a recording runs: with the attribute outputs learnt so far, it returns the
        tensors it assigned beside its outputs (``memory/attribute_outputs.py``)."""
        made.assignment = self._attributes.assignment()
        self._arguments_written = False  # what its runs write into their arguments, from here
        fn = partial(self._run_forward, callargs, made.params)
        return fn if made.assignment is None else made.assignment.wrap(fn)

    def _learn_attributes(self, made: Made) -> Refusal | None:
        """Tensor attributes the probe's forward assigned, not learnt yet (or read now too): learnt
        now, this call runs eagerly (``first_write``), later recordings return them as outputs
        (and read a state from a slot fed before each replay)."""
        states = made.attribute_states
        new = self._attributes.unknown(made.attribute_writes, states)
        if not new:
            return None
        self._attributes.learn(new, states)
        names = {id(m): n or type(m).__name__ for n, m in self.module.named_modules()}
        written = ", ".join(
            f"{names.get(id(m), type(m).__name__)}[{name!r}]"
            if not isinstance(m, nn.Module)
            else f"{names[id(m)]}.{name}"
            + (" (read too: a state)" if (id(m), name) in states else "")
            for m, name in new
        )
        return Refusal(
            "learn",
            "first_write",
            f"forward assigns {written}: a tensor recorded as an output from the next call",
        )

    def _draws_refusal(self, refusal: Refusal | None, draws: Watch | None) -> Refusal | None:
        """The probe's draws from Python's or numpy's RNG (``guards/host_choices.py``): draws that
        only chose are learnt (this call runs eagerly, later ones are keyed by them); draws that are
        not those this key learnt retire, as any other host draw does."""
        if draws is None:
            return refusal
        if refusal is not None and refusal.draws_only:
            learnt = self._choices.learnt(draws)
            return refusal if learnt is None else Refusal("learn", "host_choices", learnt)
        changed = self._choices.changed("forward", draws) if refusal is None else None
        return refusal if changed is None else Refusal("module", changed)

    def _cpu_draws_refusal(self, refusal: Refusal | None, reads: Provenance) -> Refusal | None:
        """Draws from torch's CPU generator beside a GPU model that are only read on the host
        (transformers' LayerDrop): at first sight this call runs eagerly and the next recording
        call's probe finds them (``reads``, a dispatch mode); found, they are learnt: drawn and
        read before choosing a recording from then on, keyed by what was read. A drawn value
        reaching the computation, or draws other than the key's, retire as before."""
        if refusal is None or not refusal.cpu_draws_only:
            return refusal
        if not (self.on.input_reads and self.on.host_rng) or self._input_reads.drawn_to is not None:
            return refusal
        if not self._learn_draws:
            self._learn_draws = True
            return Refusal("learn", "host_draws", "host draws: the next recording call learns them")
        if (
            reads.escaped
            or not reads.draws
            or not self._input_reads.learn_draws(reads.reads, reads.draws)
        ):
            return refusal
        return Refusal(
            "learn",
            "host_draws",
            f"{len(reads.draws)} host draw(s), {len(reads.reads)} read(s) of them: drawn before "
            "choosing a recording from now on",
        )

    def _recorded_draws(self, made: Made, runs: list[Watch], state: CallState) -> None:
        """A warm-up or capture run that drew otherwise than its key learnt, or from a private
        host generator: not kept, retired."""
        changed = self._choices.changed("forward", *runs)
        refusal = self._private_draws(state) or (
            Refusal("module", changed) if changed is not None else None
        )
        if refusal is not None:
            made.recording.free()
            made.recording, made.refusal = None, refusal

    def _private_draws(self, state: CallState) -> Refusal | None:
        """A run that drew from a private host generator the call reaches (``random.Random``,
        numpy's: ``verify/host_generators.py``): a replay would repeat the draw; retired."""
        if not self.on.host_rng:
            return None
        why = state.host_generators.drawn("forward")
        return None if why is None else Refusal("module", why)

    def _probe(self, made: Made, fn: Any, callers: list[torch.Tensor]) -> Refusal | None:
        """One eager forward and backward that finds what no replay can repeat (verify/probe.py)."""
        if not self.on.record_probe:
            return None
        return probe(
            self.module,
            fn,
            made.static_inputs,
            made.params,
            made,
            callers,
            self._attributes,
            self.on.host_rng,
            self._choices.drawn_to,
            self._input_reads.drawn_to,
            (self.on.data_rebind, self.on.output_state),
        )

    def _class_writes(self, before: tuple) -> Refusal | None:
        """A class attribute the probe's forward changed (``type(self).calls += 1``): a replay would
        not. A write into the model's class, as an attribute's: this call eager, again retires."""
        if self._forward_inputs is None or not self.on.side_effects:
            return None
        changed = self._forward_inputs.changed(before, classes=True)
        if changed is None:
            return None
        return Refusal("call", f"forward changes class attribute {changed}; a replay would not")

    def _eager_only(self, run: HeldOutput) -> Refusal | None:
        """What the probe's forward did that only eager can do, as the caller sees it: wrote into
        a container it was passed (``sink.append``, ``feats["h"] = h``: the caller's is eager's
        alone to fill, so the signature runs eagerly), or opened a file for writing (retires)."""
        if not self.on.record_probe:
            return None
        if not self._arguments_written:
            return _files_refusal(run)
        return Refusal(
            "signature",
            "arguments_written",
            "the forward writes into a container it is passed (a list appended to, a dict "
            "filled): a replay runs no Python, the caller's container would stay as it was",
        )

    def _reference(self, made: Made, callargs: CallArgs, state: CallState) -> Shadow | None:
        """The verification's eager forward, from the state before the call (the probe's changes put
        back first), run before the warm-up and capture: eager's activations come and go before the
        recording's static memory exists, never beside it. An error here is the recording's."""
        if not self.on.verify_recording:
            return None
        state.restore()
        run = partial(self._run_forward, callargs, made.params)
        return Shadow(
            self.module,
            run if made.assignment is None else made.assignment.wrap(run),
            callargs.tensors,
            made.params,
            made.written,
            self._shadow_held(),
            list(made.written_inputs),
            self.on.data_rebind,
        )

    def _judge(self, made: Made, call: int) -> Made | None:
        """What the probe refused, and outputs that differ between the probe's call and the
        recorded one: the signature or the call runs eagerly, or the recorder retires."""
        refusal = made.refusal
        if refusal is not None:
            if refusal.scope == "signature":
                self._refused[made.key] = self._not_recorded = refusal.reason
                self.journal.add("refuse", call, refusal.reason, refusal.detail)
            elif refusal.scope == "call":
                self._wrote(refusal.reason, call)
            elif refusal.scope == "learn":  # this call runs eagerly; a later one records
                self._not_recorded = refusal.reason
                self.journal.add("refuse", call, refusal.reason, refusal.detail)
            else:
                self._retire(refusal.reason, call)
            return None
        varying = self._varying_outputs(made.probed, made.recording)
        if varying is not None:
            made.recording.free()
            self._refused[made.key] = self._not_recorded = "output_constant"
            self.journal.add("refuse", call, "output_constant", varying)
            return None
        return made

    def _wrote(self, reason: str, call: int) -> None:
        """A write into the model, which this call makes eagerly (``guards/fills.py``): the first
        one (transformers sets ``config.problem_type``) or a cache filled for a new state (the
        recordings of the old state dropped: re-record) records at a later call; a write made at
        two calls in a row retires."""
        verdict = self._fills.verdict(call)
        if verdict == "repeats":
            self._retire(reason, call)
            return
        self._not_recorded = "first_write" if verdict == "first_write" else "cache_fill"
        if verdict == "fill" and self.on.cache_fills:
            self.lifecycle.rerecord(f"cache_fill: {reason}", call)
        else:
            self.journal.add("refuse", call, self._not_recorded, reason)

    def _clears(self, made: Made) -> bool:
        """Whether this call will replay the recording (not a watched first use, run eagerly)."""
        autocast = (
            torch.is_autocast_enabled(self._device_kind) and torch.is_autocast_cache_enabled()
        )
        return not (self.on.reentry and (made.multi_use or autocast))

    def _varying_outputs(self, probed: list[OutputTree], recording: Recording) -> str | None:
        """The probe's call and the recorded one must return the same structure and constants
        (:mod:`replaykit.memory.outputs`): a replay hands back the recorded ones."""
        if not probed or not self.on.output_constants:
            return None
        difference = probed[0].difference(recording.out_spec)
        if difference is None:
            return None
        return f"{difference} (the probe's call, then the recording's): a replay would freeze one"
