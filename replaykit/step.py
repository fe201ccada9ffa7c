"""Whole-step replay: forward, loss, backward and the optimizer step, recorded and replayed.

    step = rk.TrainStep(model, loss_fn, optimizer, scaler=None, max_norm=None, ema=None, accumulate=1)
    for x, y in loader:
        loss = step(x, y)          # one micro-batch; every ``accumulate``-th call steps the optimizer

A call runs one *phase*: ``step`` (``accumulate=1``), else ``first`` (gradients start from None),
``accumulate`` and ``last`` (plus the optimizer step); each phase and input signature is one
recording. The eager twin (``replay=False``) runs the same body with no graphs: the parity
reference. The step adds to :class:`~replaykit.route.Entry` its checks, its key (phase, incoming
gradients, host values, what ``loss_fn`` reads) and the hand-back of gradients between
micro-batches: fresh aliases of the static buffers, copied out before a first phase overwrites
them while held; the loss handed back is a copy.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .backends import Backend, Scratch, module_device, resolve_backend
from .backends.gaps import capturing, gap
from .distributed.ranks import RankAgreement
from .distributed.reduction import DDPReduction, arm_reducer
from .distributed.watchdog import Watchdog
from .ema import EMA
from .errors import ReplayWarning, check_loss
from .guards.code import ForwardInputs, LossInputs
from .guards.distributed import ddp_refusal, is_ddp
from .guards.fills import Fills
from .guards.host_choices import HostChoices
from .guards.input_reads import InputReads
from .guards.module import gradient_hooks
from .guards.optimizer import (
    GRAD,
    FrozenGrads,
    OptimizerTail,
    OptimizerWatch,
    optimizer_hooks,
    scaler_key,
)
from .guards.signature import SIGNATURE_PARTS, UnhashableArgument, signature, split_call
from .guards.storage import GLOBAL_HOOKS, module_hooks
from .guards.watch import epoch as guard_epoch
from .memory.attribute_outputs import StepAttributes
from .memory.copy_out import StepGrads
from .memory.foreign import ForeignLeaves
from .memory.layout import aligned_key, copy_into
from .memory.pool import MemoryPool, storage_bytes
from .protections import Switches
from .route import Entry, signature_of
from .step_config import PRECISIONS, StepConfig, fixed
from .step_recording import RecordingSteps, StepRecording
from .verify import weight_caches
from .verify.call_state import CallState
from .verify.probe import foreign_leaves
from .verify.step_check import StepSnapshot, difference, end_state, unique

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


__all__ = ["EMA", "StepConfig", "StepRecording", "TrainStep"]


class TrainStep(RecordingSteps, Entry):
    """A training step (forward, loss, backward, optimizer) replayed from graphs; see the module docstring.

    Its settings are ``config`` (a :class:`StepConfig`), readable as attributes and fixed:
    ``step.accumulate = 4`` raises. ``max_norm`` keys the recordings and may change;
    ``on_optimizer_step`` runs outside them.
    """

    kind = "TrainStep"
    key_parts = ("phase", "state", "requires_grad", "incoming_grads", "host_values", "loss_reads")
    key_parts += ("forward_reads", "foreign_leaves", *SIGNATURE_PARTS)
    model, loss_fn = fixed("model", "config.model"), fixed("loss_fn", "config.loss_fn")
    optimizer = fixed("optimizer", "config.optimizer")
    scaler, ema = fixed("scaler", "config.scaler"), fixed("ema", "config.ema")
    accumulate = fixed("accumulate", "config.accumulate")
    precision = fixed("precision", "config.precision")
    replay, warmup = fixed("replay", "config.replay"), fixed("warmup", "config.warmup")
    max_recordings = fixed("max_recordings", "config.max_recordings")
    check_every = fixed("check_every", "config.check_every")
    backend, device = fixed("backend", "_backend"), fixed("device", "_device")
    disabled = fixed("disabled", "on.off")

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        max_norm: float | None = None,
        ema: EMA | None = None,
        accumulate: int = 1,
        precision: str = "32",
        replay: bool = True,
        backend: str = "auto",
        warmup: int = 1,
        max_recordings: int = 8,
        max_rerecords: int = 8,
        check_every: int = 0,
        strict: bool = False,
        trust_optimizer: bool = False,
        unsafe_disable: tuple[str, ...] | list[str] | str = (),
        on_optimizer_step: Callable[[], None] | None = None,
        pool: MemoryPool | None = None,
        process_group: Any = None,
        replay_timeout: float | None = None,
        collectives_in_graph: bool = False,
        ddp: nn.Module | None = None,
    ) -> None:
        self.config = c = StepConfig(
            model, loss_fn, optimizer, scaler=scaler, max_norm=max_norm, ema=ema,
            accumulate=accumulate, precision=precision, replay=replay, backend=backend,
            warmup=warmup, max_recordings=max_recordings, max_rerecords=max_rerecords,
            check_every=check_every, strict=strict, trust_optimizer=trust_optimizer,
            unsafe_disable=unsafe_disable, on_optimizer_step=on_optimizer_step, pool=pool,
            process_group=process_group, replay_timeout=replay_timeout,
            collectives_in_graph=collectives_in_graph, ddp=ddp,
        )  # fmt: skip
        self.on = on = Switches(c.unsafe_disable)
        self._ddp_wrapped = is_ddp(model) or ddp is not None  # read on every call
        self._trust = c.trust_optimizer or not on.optimizer_trust
        self.max_norm = max_norm  # keys the recordings: may change
        # Python run after every optimizer step (a replay runs none)
        self.on_optimizer_step = on_optimizer_step
        self._device = module_device(model) or torch.device("cpu")
        self._backend: Backend | None = resolve_backend(backend, model, c.pool) if replay else None
        # shared with other entry points (None: the backend's private pool); read per call
        self._pool = c.pool if c.replay else None
        if self._pool is not None:
            self._pool.join(self)
        self.lifecycle = self._lifecycle(
            f"TrainStep({type(model).__name__})", model, c.strict, max_rerecords
        )
        if on.state_identity:  # which parameters each group steps: unless param_identity is off
            self.lifecycle.add_watch(OptimizerWatch(optimizer, scaler, ema, on.param_identity))
        self._per_call_state()
        self._recording_state(c)
        self._distributed_state(c)

    def _distributed_state(self, c: StepConfig) -> None:
        """Under DDP: its reduction between the two graphs; with ranks: the route agreement and
        the watchdog (``replay_timeout``). Neither exists, and nothing is added per call, otherwise."""
        self._watchdog: Watchdog | None = None
        self._agreement: RankAgreement | None = None
        self._ddp: DDPReduction | None = None
        wrapper = c.ddp if c.ddp is not None else c.model if is_ddp(c.model) else None
        if not c.replay:
            return
        if wrapper is not None and self._refusal is None:
            self._ddp = DDPReduction(wrapper)
        ranks = dist.is_available() and dist.is_initialized()
        if ranks and c.replay_timeout is not None:
            self._watchdog = Watchdog(c.replay_timeout, dist.get_rank())
        grouped = wrapper is not None or c.process_group is not None
        if ranks and grouped and self.on.rank_agreement:
            group = c.process_group if c.process_group is not None else wrapper.process_group
            self._agreement = RankAgreement(group, self._watchdog)

    def _per_call_state(self) -> None:
        """Counters, recordings and the gradients handed out between micro-batches."""
        self._rg_keys: dict[tuple[bool, ...], int] = {}
        self._rg: tuple[bool, ...] = ()
        self._rg_key = 0
        self._trainable: list[nn.Parameter] = []
        self._frozen = FrozenGrads(self.on.param_identity)  # see _frozen_grad
        self._tail = OptimizerTail()  # where the optimizer step runs
        self._tail_failed = False  # a capture failed inside the optimizer step
        self._find_params()
        self._calls = 0
        self._micro = 0  # micro-batches into the current optimizer step
        self._steps = 0  # optimizer steps taken (eager or replayed)
        self._recordings: dict[tuple, StepRecording] = {}
        self._refused: dict[tuple, str] = {}  # signatures whose recording differed from eager
        self._replayed = 0  # calls that replayed (the shadow check samples them)
        # gradients handed out (between micro-batches, or a parameter the optimizer does not step)
        # and the static storages behind them, copied out before a replay overwrites them
        self._grads = StepGrads()
        self._hooks_epoch, self._has_hooks = -1, False

    def _recording_state(self, c: StepConfig) -> None:
        """What the recording call learns and keeps between calls (``_record``, ``_reference``)."""
        # a reference step runs in the pool's free memory (backends/scratch.py) until one leaves something there
        self._in_pool = True
        # a reference step that raised: its pool leftovers are looked at by the next call (frames gone)
        self._unchecked: Scratch | None = None
        self._loss_inputs = (
            LossInputs(c.loss_fn, c.model) if c.replay and self.on.loss_inputs else None
        )
        self._loss_key: tuple = ()
        # what forward reads outside the model (globals, cells, class values), keyed as capture's
        calls = self._loss_inputs.names if self._loss_inputs is not None else ()
        self._forward_inputs = (
            ForwardInputs(c.model, calls) if c.replay and self.on.forward_inputs else None
        )
        self._forward_key, self._host_held = (), []  # see _hold_host_tensors
        # input-derived host reads (a padding mask's .all()): learnt at recording, keyed per call
        self._input_reads = InputReads(keyed=self.on.input_reads)
        # Python's and numpy's draws that only choose (LayerDrop): learnt at recording, drawn and keyed per call
        self._choices = HostChoices(keyed=self.on.host_choices)
        # the reads' watch, the host feeds: each set once a capture without it failed (_capture_failed)
        self._watch_reads = self._feed_host = False
        # writes into the model: a first write, a cache filled, or per-call Python
        self._fills = Fills()
        # tensors the forward assigns to attributes: recorded as outputs (memory/attribute_outputs.py)
        self._attrs = StepAttributes(c.model, self.lifecycle.guard.key_by_kind)
        self._learn_draws = False  # set at the first host draw seen: the next reference learns them
        # tensors loss_fn holds and writes in place (a running mean): snapshotted once seen written
        self._written: list[torch.Tensor] = []
        self._walking, self._foreign = False, []
        # leaves outside the model the loss reaches (a second network): recorded from the next recording call
        self._foreign_leaves = ForeignLeaves(self.on.foreign_owners)
        if self._loss_inputs is not None and self._loss_inputs.unwatched:
            warnings.warn(
                f"replaykit: TrainStep cannot see what loss_fn reads through {', '.join(self._loss_inputs.unwatched)}: "
                "a Python value read there is frozen at the recording call",
                ReplayWarning,
                stacklevel=3,
            )

    # ----------------------------------------------------------------- read-outs (journal, counts, ... : Entry)
    def _label(self) -> str:
        mode = self._backend.name if self._backend is not None else "eager twin"
        return f"TrainStep {type(self.config.model).__name__} {mode}"

    # ----------------------------------------------------------------- memory
    def _memory_rows(self) -> list[dict[str, Any]]:
        """Per recording its phase, static inputs, loss and the gradient buffers it leaves."""
        return [
            {
                "phase": key[0],
                "signature": signature_of(rec.static_inputs),
                "static_inputs": storage_bytes(rec.static_inputs),
                "static_outputs": storage_bytes([rec.loss]),
                "static_grads": storage_bytes(rec.grads_out),
            }
            for key, rec in self._recordings.items()
        ]

    def quiesce(self, call: int) -> bool:
        """A shared pool's question before another entry point runs there: copy out the gradients
        handed out; False between micro-batches (the static gradient buffers are ``.grad``)."""
        if self._micro not in (0, self.config.accumulate):
            return False
        self._copy_out(self._calls)  # journaled at its own latest call
        return not self._grads.live_alias()

    def static_tensors(self) -> list[torch.Tensor]:
        """Each recording's loss and the gradient buffers it leaves (what another graph in a shared pool may overwrite)."""
        out = []
        for rec in self._recordings.values():
            out.append(rec.loss)
            out += [g for g in rec.grads_out if g is not None]
            out += rec.foreign.tensors() if rec.foreign is not None else []
        return out

    # ----------------------------------------------------------------- the call
    def _phase(self, acc: int) -> str:
        if acc == 1:
            return "step"
        if self._micro == 1:
            return "first"
        return "last" if self._micro == acc else "accumulate"

    def _find_params(self) -> None:
        """The model's and the optimizer's parameters (again after a re-record: a group may have been added)."""
        stepped = self._frozen.stepping(self.optimizer)
        self.params = unique([*self.model.parameters(), *stepped])
        refusal = ddp_refusal(self.model)
        tail = self._tail.place(self.optimizer, self.scaler, self.device, self._trust)
        if tail is not None and self._under_ddp():  # the reduction's gap would end the step
            refusal, self._tail.eager = refusal or tail, None
        self._refusal = refusal
        self._rg = ()
        self._refresh_trainable()

    @property
    def optimizer_eager(self) -> str | None:
        """Why the optimizer step runs eagerly after each replayed forward+backward (it cannot be
        captured: ``capturable=False``, a step of its own, a non-fused optimizer under a
        GradScaler), or None: it is recorded with them."""
        return self._tail.eager

    def _refresh_trainable(self) -> None:
        """Which parameters require grad: a recording freezes it (a layer frozen later would still
        get its recorded gradient and optimizer update), so it keys the recordings."""
        rg = tuple(map(_REQUIRES_GRAD, self.params))
        if rg != self._rg:
            self._rg = rg
            self._rg_key = self._rg_keys.setdefault(rg, len(self._rg_keys))
            self._trainable = [p for p, r in zip(self.params, rg, strict=True) if r]
            self._frozen.refresh(self.params)
            self._hooks_epoch = -1

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._calls += 1
        self._refresh_trainable()
        config = self.config
        self._micro = self._micro % config.accumulate + 1
        phase = self._phase(config.accumulate)
        if not config.replay:  # the eager twin
            return self._eager(phase, None, args, kwargs)
        return self._route(phase, args, kwargs)

    def early_checks(self) -> str | None:
        """The optimizer/model refusal (DDP, an untrusted step), then the warm-up."""
        if self._refusal is not None:
            return self._refusal
        if self._steps < self.config.warmup:
            return "warmup"
        if self._ddp is not None:
            if not self._ddp.ready():
                return "ddp_buckets"  # DDP lays its buckets out anew in its second forward
            why = self._ddp.stream_refusal()
            if why is not None:
                return why
        if weight_caches.FREES_HELD_CASTS:
            return weight_caches.region_reason(self._device.type)
        return None

    def late_checks(self, call: int) -> str | None:
        """What a reference step that raised left in the pool, looked at before any replay can
        overwrite it; then hooks (Python a replay skips); then a frozen parameter's gradient."""
        if self._unchecked is not None:
            scratch, self._unchecked = self._unchecked, None
            self._left_in_pool(scratch)
        return "hooks" if self.on.hooks and self._hooks() else self._frozen_grad()

    def _frozen_grad(self) -> str | None:
        """Eager (:class:`FrozenGrads`) when this call steps the optimizer in its graph while a
        frozen parameter it steps holds a ``.grad``; that step zeroes it: the next call replays."""
        if self._frozen.params and self._micro == self.config.accumulate:
            return self._frozen.reason() if self._tail.eager is None else None
        return None

    def _route(self, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        call = self._calls
        state, why = self.admit(call)
        if why is None:
            try:
                callargs = split_call(args, kwargs)
                key = self._input_reads.key(self._key(phase, state, callargs), callargs.tensors)
                key = self._choices.key(key)
            except UnhashableArgument as exc:
                why = exc.reason
            else:
                # eager's backward gives an input requiring grad a .grad; a static copy none
                if any(map(_REQUIRES_GRAD, callargs.tensors)):
                    why = "input_requires_grad"
                else:
                    rec, why = self.choose(self._recordings, key, call)
                    if rec is not None and rec.back is not None:  # it writes the batch
                        why = rec.back.refusal(callargs.tensors)
        alias = False
        # before a replay that makes gradients anew: a first micro-batch, or a step leaving some
        if (
            why is None
            and rec is not None
            and (phase == "first" or (phase == "step" and rec.after))
        ):
            self._copy_out(call)
            alias = self.on.copy_out and self._grads.live_alias()
        if self._agreement is not None:  # every rank acts on the same route
            route = "eager" if why is not None or alias else "record" if rec is None else "replay"
            if self._agreement.agree(route) is not None and route != "eager":
                why = "peer_route"
        if why is not None or alias or rec is None:
            self._choices.rewind()  # the call's body draws itself
        if why is not None:
            with self.held(why):
                return self._eager(phase, why, args, kwargs)
        if alias:
            return self._eager(phase, "live_alias", args, kwargs)
        if rec is None:
            with self.lifecycle.lock:
                loss = self._record(phase, key, callargs, args, kwargs)
            self._agree_kept(key)
            return loss
        self._replayed += 1
        check = self.config.check_every
        if check and (self._replayed - 1) % check == 0:
            return self._checked_replay(phase, rec, callargs, args, kwargs)
        self._replay(rec, callargs, f"its replayed {phase} (call {call})")
        if rec.back is not None:  # what the step wrote of the batch, into the caller's
            rec.back.copy_back(callargs.tensors)
        self.journal.tick("replay", call, phase)
        return self._after(phase, rec)

    def _agree_kept(self, key: tuple) -> None:
        """After a recording call: a recording one rank kept while another's was refused or
        retired is dropped, so the next call of that key routes the same on every rank."""
        if self._agreement is None:
            return
        kept = key in self._recordings
        if self._agreement.agree("replay" if kept else "eager") is None or not kept:
            return
        self._recordings.pop(key).region.free()
        self._refused[key] = "peer_route"
        self.journal.add("refuse", self._calls, "peer_route", "a peer rank kept no recording")

    def _checked_replay(
        self, phase: str, rec: StepRecording, callargs: Any, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """The shadow check (``check_every``): replay, then the twin's body from the same state; a
        difference retires the step and the state is eager's."""
        call = self._calls
        self._choices.rewind()  # the eager body the replay is checked against draws itself
        # the call state, not the snapshot alone: the replay ran what loss_fn's modules do (a
        # teacher's statistics) and the eager body runs it again (step_recording.py)
        snapshot = self._call_state(tensors=True)
        self._replay(rec, callargs)
        self.journal.tick("replay", call, phase)
        found, loss = self._against_eager(snapshot, rec.loss, phase, args, kwargs)
        if found is None and rec.back is not None:  # eager wrote the batch: as the replay's copies?
            found = rec.back.difference(callargs.tensors)
        self.journal.add("check", call, "step", found)
        if found is None:
            return self._after(phase, rec)
        self._retire(f"diverged: {found}", call)
        if phase in ("step", "last"):
            self._stepped()
        return loss

    def _replay(self, rec: StepRecording, callargs: Any, watched: str | None = None) -> None:
        """The batch into the static inputs, the graph, then what eager's Python leaves besides the
        tensors it wrote: the host draws advanced, a second network's gradients handed out.
        ``watched``: what the watchdog names if the device hangs in it."""
        for static, x in zip(rec.static_inputs, callargs.tensors, strict=True):
            copy_into(static, x)
        if rec.foreign is not None:
            rec.foreign.copy_in()
        if rec.assignment is not None:  # the states the forward reads, into its slots
            rec.assignment.feed()
        rec.region.replay()
        if watched is not None and self._watchdog is not None:
            self._watchdog.device(self._device, watched)
        if rec.foreign is not None:
            rec.foreign.hand_out()
        self._input_reads.advance()  # the CPU generator where eager's host draws leave it
        self._choices.advance()  # Python's and numpy's too
        if rec.tail:
            self._eager_tail(rec)

    def _snapshot(self, tensors: bool) -> StepSnapshot:
        generators = self._loss_inputs.generators() if self._loss_inputs is not None else ()
        return StepSnapshot(
            self.model,
            self.optimizer,
            self.scaler,
            self.ema,
            [*self._trainable, *self._foreign_leaves.leaves],
            tensors,
            generators,
            self._written,
        )

    def _against_eager(
        self, snapshot: CallState, loss: torch.Tensor, phase: str, args: tuple, kwargs: dict
    ) -> tuple[str | None, torch.Tensor]:
        """The recorded work's end state against the twin's body run from ``snapshot``: the first
        difference (or None) and eager's loss. The state left behind is eager's."""
        state = self._judged()
        replayed = end_state(*state, loss, clone=True, extra=snapshot.outside)
        snapshot.restore()
        eager = self._body(phase, args, kwargs)
        now = end_state(*state, eager, clone=False, extra=snapshot.outside)
        return difference(replayed, now), eager

    def _key(self, phase: str, state: Any, callargs: Any) -> tuple:
        grads = list(map(GRAD, self._trainable))
        incoming = (
            0
            if grads.count(None) == len(grads)
            else tuple(0 if g is None else g.data_ptr() for g in grads)
        )
        on = self.on
        hyper = self._host_values() if on.host_values else ()
        self._loss_key = self._loss_inputs.key() if self._loss_inputs is not None else ()
        self._forward_key = self._forward_inputs.key() if self._forward_inputs is not None else ()
        return (
            phase,
            state,
            self._rg_key,
            incoming,
            hyper,
            self._loss_key,
            self._forward_key,
            self._foreign_leaves.key(),
            *signature(callargs, self._device.type, True, aligned_key),
        )

    def _host_values(self) -> tuple:
        """The optimizer's, scaler's and clip's host values (``OptimizerTail.key``); once they vary
        the step leaves the graph and the recordings made with it are dropped."""
        c = self.config
        clip = None if self.max_norm is None else float(self.max_norm).hex()
        hyper = self._tail.key(c.optimizer, (clip, scaler_key(c.scaler)), self._under_ddp())
        if hyper is None:
            self.lifecycle.rerecord(f"host_values: {self._tail.eager}", self._calls)
            return self._host_values()
        return hyper

    def _under_ddp(self) -> bool:
        """Whether DDP wraps the model or the caller runs it (``ddp=``): fixed, found once."""
        return self._ddp_wrapped

    # ----------------------------------------------------------------- eager (the twin)
    def _body(self, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """One micro-batch, and the optimizer step after the last: the twin's code and the recorded code."""
        c = self.config
        dtype = PRECISIONS[c.precision]
        ctx = torch.autocast(self._device.type, dtype=dtype) if dtype is not None else _NULL
        # under DDP: its forward, no_sync on accumulation micro-batches; captured (split): the
        # wrapped module, DDP's host work between the graphs (backends/gaps.py, reduction.py).
        # ddp= (the caller runs DDP's forward): the model, the reducer armed before an eager
        # synchronising backward as Lightning's manual_backward does; captured, the gap after it
        split = self._ddp is not None and capturing()
        sync = phase in ("step", "last")
        if split and c.ddp is None:
            assert self._ddp is not None
            gap(partial(self._ddp.before_forward, sync), first=True)
        model = c.model.module if split and c.ddp is None else c.model
        quiet = c.model.no_sync() if not sync and not split and is_ddp(c.model) else _NULL
        with quiet:
            with ctx:
                loss = check_loss(c.loss_fn(model, *args, **kwargs))
            # the recording call: does the loss reach parameters we do not hand gradients to?
            if self._walking:
                self._foreign = foreign_leaves(
                    [loss], [*self.params, *self._foreign_leaves.known()]
                )
            scaler = c.scaler
            scaled = loss / c.accumulate if c.accumulate > 1 else loss
            if scaler is not None:
                scaled = scaler.scale(scaled)
            if sync and not split and c.ddp is not None:
                arm_reducer(c.ddp)
            scaled.backward()
        if split and sync:
            assert self._ddp is not None
            grads = [p.grad for p in self._ddp.params]
            gap(partial(self._ddp.after_backward, grads, self._watchdog))
        if sync and not (capturing() and self._tail.eager is not None):
            self._tail_failed = capturing()  # recorded: a capture failing there is the step's
            self._optimizer_tail()
            self._tail_failed = False
        return loss.detach()

    def _optimizer_tail(self) -> None:
        """Clip, the optimizer (and scaler) step, the EMA, zero_grad: recorded after the backward,
        or run eagerly after each replay when the optimizer cannot be captured (``OptimizerTail``)."""
        c = self.config
        scaler, optimizer = c.scaler, c.optimizer
        if self.max_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            params = [p for p in self._trainable if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(
                params, self.max_norm, foreach=True, error_if_nonfinite=False
            )
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if c.ema is not None:
            c.ema.update()
        optimizer.zero_grad(set_to_none=True)

    def _eager_tail(self, rec: StepRecording) -> None:
        """A recording that left the optimizer out: its gradients as ``.grad``, then the tail, as eager's."""
        for p, g in zip(self._trainable, rec.grads_out, strict=True):
            p.grad = g
        self._optimizer_tail()

    def _eager(self, phase: str, reason: str | None, args: tuple, kwargs: dict) -> torch.Tensor:
        if reason is not None:
            self.lifecycle.eager(self._calls, reason)
        stream = _side_stream(self._device) if reason == "warmup" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            loss = self._body(phase, args, kwargs)
        if stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(stream)
        if phase in ("step", "last"):
            self._stepped()
        return loss

    def _stepped(self) -> None:
        self._steps += 1
        if self.on_optimizer_step is not None:
            self.on_optimizer_step()

    # ----------------------------------------------------------------- record and replay
    def _record(
        self, phase: str, key: tuple, callargs: Any, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """The recording call (the route's entry): its named steps are in :mod:`.step_recording`."""
        why = self._frozen_grad()  # again: a re-record after late_checks re-found the parameters
        if why is not None:
            return self._eager(phase, why, args, kwargs)
        return self._record_call(phase, key, callargs, args, kwargs)

    def _after(self, phase: str, rec: StepRecording) -> torch.Tensor:
        """Leave the gradients and attributes as eager would and hand back a copy of the loss."""
        if rec.assignment is not None:
            rec.assignment.hand_out([rec.loss], rec.written, self.on.attribute_outputs)
        if phase in ("step", "last"):
            self._stepped()
            # zero_grad(set_to_none=True) ran in Python at capture only; a parameter the optimizer
            # does not step keeps its gradient, as after eager's step (rec.after)
            if rec.after or (phase == "last" and not rec.tail):
                self._hand_grads(rec, rec.tail)
        else:  # between micro-batches eager's .grad holds the running sum: the static buffers
            self._hand_grads(rec)
        return rec.loss.clone()

    def _hand_grads(self, rec: StepRecording, after_tail: bool = False) -> None:
        """Each ``.grad`` as the recorded call left it: a static buffer handed out (copied out
        before a replay overwrites it while held), or None. ``after_tail``: an eager optimizer
        step ran, and the gradients it zeroed stay None."""
        if rec.handed is None:  # its recording call: nobody but the recordings holds them yet
            for g in rec.grads_out:
                if g is not None:
                    self._grads.track(g)
            rec.handed = self._grads.handouts(rec.grads_out)
        grads, params, handed = rec.grads_out, self._trainable, rec.handed
        if after_tail:
            kept = [i for i, p in enumerate(params) if p.grad is not None]
            grads, handed = [grads[i] for i in kept], [handed[i] for i in kept]
            params = [params[i] for i in kept]
        self._grads.hand_out(params, grads, handed)

    def _copy_out(self, call: int) -> None:
        """Before a first phase overwrites the gradient buffers, a handed-out gradient still held
        gets memory of its own (:class:`~replaykit.memory.copy_out.StepGrads`).

        Eager's next micro-batch makes new gradients and leaves the old ones with their holders.
        """
        if not self.on.copy_out:
            return
        moved = self._grads.copy_out()
        if moved:
            self.journal.add("copy_out", call, None, f"{moved} tensors")

    def _hooks(self) -> bool:
        """Hooks run Python a replay skips: the optimizer's and global module hooks are read every
        call; module and parameter hooks only when a watched write happened."""
        if optimizer_hooks(self.config.optimizer) or any(GLOBAL_HOOKS):
            return True
        now = guard_epoch()
        if now != self._hooks_epoch:
            self._hooks_epoch = now
            self._has_hooks = gradient_hooks(self._trainable) > 0 or module_hooks(self.model) > 0
        return self._has_hooks

    def _retire_eager(self, reason: str, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        self._retire(reason, self._calls)
        return self._eager(phase, "retired", args, kwargs)

    def _drop_recordings(self) -> None:
        """The lifecycle's drop (re-record, retire, release): free every recording; parameters and
        the optimizer's refusal are read again (a re-record may follow ``add_param_group``)."""
        self._grads.drop()  # held gradients keep their values without the recordings' memory
        for rec in self._recordings.values():
            rec.region.free()
        self._recordings.clear()
        if self.backend is not None:  # None: the eager twin (replay=False)
            self.backend.free()
        self._refused.clear()
        if self._ddp is not None:
            self._ddp.forget()
        self._grads.untrack()
        if not self.lifecycle.stopped():
            self._find_params()


_NULL = contextlib.nullcontext()
_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """Warm-up runs on a side stream on CUDA (lazy library state is set up off the capture stream)."""
    if device.type != "cuda":
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    stream = _streams[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream
