"""Whole-step replay: forward, loss, backward and the optimizer step, recorded and replayed.

(One module of about 650 lines: the route, the recording and the hand-back of gradients between
micro-batches share the step's per-phase state; what they use lives elsewhere: the lifecycle,
step_guards, step_check, loss_inputs, layout, the backends' regions.)

    step = rk.TrainStep(model, loss_fn, optimizer, scaler=None, max_norm=None, ema=None, accumulate=1)
    for x, y in loader:
        loss = step(x, y)          # one micro-batch; every ``accumulate``-th call steps the optimizer
        scheduler.step()           # a tensor lr is updated in place and read by the graph

``loss_fn(model, *batch)`` returns the loss. A call runs one *phase*: with
``accumulate=1`` the whole step (``step``); otherwise the first micro-batch (``first``:
gradients start from None), the middle ones (``accumulate``) and the last (``last``:
micro-batch plus the optimizer step). Each phase and input signature is one recording.

The eager twin is the same object with ``replay=False``: the same body (autocast,
``loss / accumulate``, scaler, clipping, optimizer, EMA, ``zero_grad(set_to_none=True)``)
with no graphs. It is the parity reference: a replayed run ends bitwise equal to it,
or the journal says why a call ran the twin's body instead (``eager`` + reason) or why
the step retired. Nothing is replayed on a stale assumption:

- the model's host values and parameter identity (:class:`~replaykit.guards.module.ModuleGuard`),
  storages (:class:`~replaykit.guards.storage.ModuleWatch`), the optimizer's, scaler's and
  clip's host values and state tensors (:mod:`replaykit.guards.optimizer`), the batch's
  signature and the identity of the gradients a phase starts from all key or guard a
  recording;
- gradients handed out between micro-batches are fresh aliases of the static
  buffers; one still held when the next step's first micro-batch would overwrite
  them gets storage of its own first (copy-out);
- the loss handed back is a copy: a kept loss never changes under its holder.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .backends import Backend, Region, Scratch, module_device, resolve_backend
from .compiled import refuse_cudagraphs
from .distributed import ddp_refusal
from .ema import EMA
from .errors import ReplayError, ReplayWarning, check_count
from .guards.code import LossInputs
from .guards.input_reads import InputReads
from .guards.module import epoch as guard_epoch
from .guards.module import gradient_hooks
from .guards.optimizer import (
    GRAD,
    OptimizerWatch,
    hyper_key,
    optimizer_hooks,
    optimizer_refusal,
    scaler_key,
)
from .guards.signature import UnhashableArgument, signature, split_call
from .guards.storage import GLOBAL_HOOKS, module_hooks
from .memory.layout import aligned_key, copy_into
from .memory.pool import MemoryPool, check_pool, storage_bytes
from .protections import disabled_protections
from .recorder import recorder_of
from .route import Lifecycle, Lifecycled
from .step_recording import RecordingSteps
from .verify.call_state import CallState
from .verify.probe import foreign_leaves
from .verify.step_check import StepSnapshot, difference, end_state, unique

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _Setting:
    """A TrainStep setting a recording bakes in and nothing keys: set at construction, refused after.

    A data descriptor, not ``__setattr__``: the per-call counters' writes stay plain attribute writes.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, step: Any, owner: type | None = None) -> Any:
        return self if step is None else step.__dict__[self.name]

    def __set__(self, step: Any, value: Any) -> None:
        if "lifecycle" in step.__dict__:
            raise ReplayError(
                f"TrainStep.{self.name} is fixed at construction (its recordings bake it in); build a new TrainStep instead"
            )
        step.__dict__[self.name] = value


_use_count = torch._C._storage_Use_Count
_PRECISIONS = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}

__all__ = ["EMA", "StepRecording", "TrainStep"]


class StepRecording:
    """One phase of one signature: its region, static inputs and loss, and the gradients it leaves."""

    __slots__ = ("grads_out", "keep", "loss", "region", "static_inputs")

    def __init__(
        self,
        region: Region,
        static_inputs: list[torch.Tensor],
        loss: torch.Tensor,
        grads_out: list,
        keep: list,
    ) -> None:
        self.region = region
        self.static_inputs = static_inputs
        self.loss = loss
        self.grads_out = (
            grads_out  # per parameter: the static gradient storage after this phase, or None
        )
        self.keep = keep  # what the key names by id (incoming gradients, tensor hyperparameters): kept alive


class TrainStep(RecordingSteps, Lifecycled):
    """A training step (forward, loss, backward, optimizer) replayed from graphs; see the module docstring."""

    # ``max_norm`` may change (it keys the recordings); ``on_optimizer_step`` runs outside them
    model, loss_fn, optimizer, scaler, ema = (
        _Setting(),
        _Setting(),
        _Setting(),
        _Setting(),
        _Setting(),
    )
    accumulate, precision, replay, backend, device = (
        _Setting(),
        _Setting(),
        _Setting(),
        _Setting(),
        _Setting(),
    )
    warmup, max_recordings, check_every, disabled = _Setting(), _Setting(), _Setting(), _Setting()

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ReplayError(
                f"TrainStep takes an nn.Module as its model, not {type(model).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ReplayError(
                f"TrainStep takes a torch.optim.Optimizer, not {type(optimizer).__name__}"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ReplayError(
                "TrainStep steps the optimizer without a closure; LBFGS re-evaluates one (and reads the loss on the "
                "host): train LBFGS with its own closure loop"
            )
        if not callable(loss_fn):
            raise ReplayError(
                f"loss_fn must be callable as loss_fn(model, *batch), not {type(loss_fn).__name__}"
            )
        check_count("accumulate", accumulate, 1)
        check_count("warmup", warmup, 0)
        check_count("max_recordings", max_recordings, 1)
        check_count("max_rerecords", max_rerecords, 0)
        check_count("check_every", check_every, 0, "(0: off)")
        if precision not in _PRECISIONS:
            raise ReplayError(f"precision {precision!r}: choose from {list(_PRECISIONS)}")
        if recorder_of(model) is not None:
            raise ReplayError(
                "the model is captured by rk.capture already: a whole step records it itself"
            )
        if replay:
            refuse_cudagraphs(model, "TrainStep")
        self.disabled = disabled_protections(unsafe_disable, "step")
        self._trust = bool(trust_optimizer) or "optimizer_trust" in self.disabled
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.scaler, self.max_norm, self.ema = scaler, max_norm, ema
        self.accumulate, self.precision, self.replay = accumulate, precision, replay
        self.warmup, self.max_recordings, self.check_every = warmup, max_recordings, check_every
        self.on_optimizer_step = (
            on_optimizer_step  # Python run after every optimizer step (a replay runs none)
        )
        self.device = module_device(model) or torch.device("cpu")
        pool = check_pool(pool)
        self.backend: Backend | None = resolve_backend(backend, model, pool) if replay else None
        # shared with other entry points (None: the backend's private pool); read per call
        self._pool = pool if replay else None
        self._pool_safe = "shared_pool" not in self.disabled
        if self._pool is not None:
            self._pool.join(self)
        me = weakref.ref(self)
        self.lifecycle = Lifecycle(
            f"TrainStep({type(model).__name__})",
            model,
            strict=strict,
            disabled=self.disabled,
            max_rerecords=max_rerecords,
            drop=lambda: (s := me()) is not None and s._drop_recordings(),
        )
        self.lifecycle.add_watch(OptimizerWatch(optimizer, scaler, ema), "state_identity")
        self._rg_keys: dict[tuple[bool, ...], int] = {}
        self._rg: tuple[bool, ...] = ()
        self._rg_key = 0
        self._trainable: list[nn.Parameter] = []
        self._find_params()
        self._calls = 0
        self._micro = 0  # micro-batches into the current optimizer step
        self._steps = 0  # optimizer steps taken (eager or replayed)
        self._recordings: dict[tuple, StepRecording] = {}
        self._refused: dict[tuple, str] = {}  # signatures whose recording differed from eager
        # a reference step runs in the pool's free memory (backends/scratch.py) until one leaves something there
        self._in_pool = True
        # a reference step that raised: what it left in the pool is looked at by the next call,
        # once the exception (whose frames hold its temporaries) is gone
        self._unchecked: Scratch | None = None
        self._replayed = 0  # calls that replayed (the shadow check samples them)
        self._handed: list[
            torch.Tensor
        ] = []  # gradient aliases handed out since the last first phase
        # static gradient storages handed out: their use count with no holder but the recordings
        self._storages: list[int] = []
        self._baseline: list[int] = []
        self._hooks_epoch, self._has_hooks = -1, False
        # the per-call path reads these plain attributes, not the settings' descriptors
        self._acc, self._warmup_steps, self._check_n, self._replaying = (
            accumulate,
            warmup,
            check_every,
            replay,
        )
        self._opt, self._device_type = optimizer, self.device.type
        self._keyed_hyper = "host_values" not in self.disabled
        self._keyed_state = "module_state" not in self.disabled
        self._copy_out_on = "copy_out" not in self.disabled
        self._check_hooks = "hooks" not in self.disabled
        self._check_effects = "side_effects" not in self.disabled
        self._loss_inputs = (
            LossInputs(loss_fn, model) if replay and "loss_inputs" not in self.disabled else None
        )
        self._loss_key: tuple = ()
        # host reads of input-derived values (a padding mask's .all()): learnt at recording, keyed per call
        self._input_reads = InputReads(keyed="input_reads" not in self.disabled)
        self._watch_reads = False  # set once a capture without the watch failed (see _record)
        self._first_write = False  # a recording call dropped for a write into the model (once)
        self._learn_draws = False  # set at the first host draw seen: the next reference learns them
        # tensors loss_fn holds and writes in place (a running mean): snapshotted once seen written
        self._written: list[torch.Tensor] = []
        self._walking, self._foreign = False, 0
        if self._loss_inputs is not None and self._loss_inputs.unwatched:
            warnings.warn(
                f"replaykit: TrainStep cannot see what loss_fn reads through {', '.join(self._loss_inputs.unwatched)}: "
                "a Python value read there is frozen at the recording call",
                ReplayWarning,
                stacklevel=2,
            )

    # ----------------------------------------------------------------- read-outs (journal, counts, ... : Lifecycled)
    @property
    def recordings(self) -> int:
        """How many recordings are held now."""
        return len(self._recordings)

    def __repr__(self) -> str:
        life = self.lifecycle
        state = (
            f"retired: {life.retire_reason}" if life.retired else f"{self.recordings} recordings"
        )
        mode = self.backend.name if self.backend is not None else "eager twin"
        return f"<TrainStep {type(self.model).__name__} {mode} {state} {self.counts}>"

    # ----------------------------------------------------------------- memory
    def memory(self) -> dict[str, Any]:
        """The bytes each recording holds (its static inputs, loss and the gradient buffers it
        leaves: distinct storages), their sum, and the bytes its memory pool reserves on the GPU
        (``pool_reserved``: None on the emulated backend; a shared pool's whole size)."""
        rows = []
        for key, rec in self._recordings.items():
            row = {
                "phase": key[0],
                "signature": "x".join("/".join(map(str, x.shape)) for x in rec.static_inputs),
                "static_inputs": storage_bytes(rec.static_inputs),
                "static_outputs": storage_bytes([rec.loss]),
                "static_grads": storage_bytes(rec.grads_out),
            }
            row["bytes"] = row["static_inputs"] + row["static_outputs"] + row["static_grads"]
            rows.append(row)
        backend = self.backend
        return {
            "recordings": rows,
            "static_bytes": sum(r["bytes"] for r in rows),
            "pool_reserved": backend.pool_reserved() if backend is not None else None,
        }

    def quiesce(self, call: int) -> bool:
        """A shared pool's question before another entry point runs there: copy out the gradients
        handed out; False between micro-batches (the static gradient buffers are ``.grad``)."""
        if self._micro not in (0, self._acc):
            return False
        self._copy_out(self._calls)  # journaled at its own latest call
        return not self._live_alias()

    def static_tensors(self) -> list[torch.Tensor]:
        """Each recording's loss and the gradient buffers it leaves (what another graph in a shared pool may overwrite)."""
        out = []
        for rec in self._recordings.values():
            out.append(rec.loss)
            out += [g for g in rec.grads_out if g is not None]
        return out

    # ----------------------------------------------------------------- the call
    def _phase(self) -> str:
        if self._acc == 1:
            return "step"
        if self._micro == 1:
            return "first"
        return "last" if self._micro == self._acc else "accumulate"

    def _find_params(self) -> None:
        """The model's and the optimizer's parameters (again after a re-record: a group may have been added)."""
        self.params = unique(
            [
                *self.model.parameters(),
                *(p for g in self.optimizer.param_groups for p in g["params"]),
            ]
        )
        self._refusal = ddp_refusal(self.model) or optimizer_refusal(
            self.optimizer, self.scaler, self.device, self._trust
        )
        self._rg = ()
        self._refresh_trainable()

    def _refresh_trainable(self) -> None:
        """Which parameters require grad: a recording freezes it (a layer frozen later would still
        get its recorded gradient and optimizer update), so it keys the recordings."""
        rg = tuple(map(_REQUIRES_GRAD, self.params))
        if rg != self._rg:
            self._rg = rg
            self._rg_key = self._rg_keys.setdefault(rg, len(self._rg_keys))
            self._trainable = [p for p, r in zip(self.params, rg, strict=True) if r]
            self._hooks_epoch = -1

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._calls += 1
        self._refresh_trainable()
        self._micro = self._micro % self._acc + 1
        phase = self._phase()
        if not self._replaying:  # the eager twin
            return self._eager(phase, None, args, kwargs)
        return self._route(phase, args, kwargs)

    def _route(self, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        call = self._calls
        life = self.lifecycle
        stopped = life.stopped()
        if stopped is not None:
            return self._eager(phase, stopped, args, kwargs)
        if self._refusal is not None:
            return self._eager(phase, self._refusal, args, kwargs)
        if self._steps < self._warmup_steps:
            return self._eager(phase, "warmup", args, kwargs)
        if not life.owns_thread():
            with life.lock:
                return self._eager(phase, "thread", args, kwargs)
        if self._unchecked is not None:  # before any replay can overwrite what it left
            scratch, self._unchecked = self._unchecked, None
            self._left_in_pool(scratch)
        mode = life.mode()
        if mode is not None:
            return self._eager(phase, mode, args, kwargs)
        if self._check_hooks and self._hooks():
            return self._eager(phase, "hooks", args, kwargs)
        state, eager = life.gate(call, bool(self._recordings))
        if eager is not None:
            return self._eager(phase, eager, args, kwargs)
        try:
            callargs = split_call(args, kwargs)
            key = self._input_reads.key(self._key(phase, state, callargs), callargs.tensors)
        except UnhashableArgument as exc:
            return self._eager(phase, exc.reason, args, kwargs)
        if any(
            map(_REQUIRES_GRAD, callargs.tensors)
        ):  # eager's backward gives it a .grad; a static copy none
            return self._eager(phase, "input_requires_grad", args, kwargs)
        rec = self._recordings.get(key)
        if rec is None:
            refused = self._refused.get(key)
            if refused is not None:
                return self._eager(phase, refused, args, kwargs)
            if len(self._recordings) >= self.max_recordings:
                return self._eager(phase, "budget", args, kwargs)
        if self._pool is not None and not self._pool.claim(self, call, self._pool_safe):
            return self._eager(phase, "pool_busy", args, kwargs)
        if rec is None:
            with life.lock:
                return self._record(phase, key, callargs, args, kwargs)
        if phase == "first":
            self._copy_out(call)
            if self._copy_out_on and self._live_alias():
                return self._eager(phase, "live_alias", args, kwargs)
        self._replayed += 1
        if self._check_n and (self._replayed - 1) % self._check_n == 0:
            return self._checked_replay(phase, rec, callargs, args, kwargs)
        for static, x in zip(rec.static_inputs, callargs.tensors, strict=True):
            copy_into(static, x)
        rec.region.replay()
        self._input_reads.advance()  # the CPU generator where eager's host draws leave it
        self.journal.tick("replay", call, phase)
        return self._after(phase, rec)

    def _checked_replay(
        self, phase: str, rec: StepRecording, callargs: Any, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        """The shadow check (``check_every``): replay, then the twin's body from the same state; a
        difference retires the step and the state is eager's."""
        call = self._calls
        # the call state, not the snapshot alone: the replay ran what loss_fn's modules do (a
        # teacher's statistics) and the eager body runs it again (step_recording.py)
        snapshot = self._call_state(tensors=True)
        for static, x in zip(rec.static_inputs, callargs.tensors, strict=True):
            copy_into(static, x)
        rec.region.replay()
        self._input_reads.advance()
        self.journal.tick("replay", call, phase)
        found, loss = self._against_eager(snapshot, rec.loss, phase, args, kwargs)
        self.journal.add("check", call, "step", found)
        if found is None:
            return self._after(phase, rec)
        self._retire(f"diverged: {found}", call)
        if phase in ("step", "last"):
            self._stepped()
        return loss

    def _snapshot(self, tensors: bool) -> StepSnapshot:
        generators = self._loss_inputs.generators() if self._loss_inputs is not None else ()
        return StepSnapshot(
            self.model,
            self.optimizer,
            self.scaler,
            self.ema,
            self._trainable,
            tensors,
            generators,
            self._written,
        )

    def _against_eager(
        self, snapshot: CallState, loss: torch.Tensor, phase: str, args: tuple, kwargs: dict
    ) -> tuple[str | None, torch.Tensor]:
        """The recorded work's end state against the twin's body run from ``snapshot``: the first
        difference (or None) and eager's loss. The state left behind is eager's."""
        state = (self.model, self.optimizer, self.scaler, self.ema, self._trainable)
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
        if self._keyed_hyper:
            extra = (
                None if self.max_norm is None else float(self.max_norm).hex(),
                scaler_key(self.scaler),
            )
            hyper: tuple = hyper_key(self._opt, extra)
        else:
            hyper = ()
        if not self._keyed_state:
            state = None
        self._loss_key = self._loss_inputs.key() if self._loss_inputs is not None else ()
        return (
            phase,
            state,
            self._rg_key,
            incoming,
            hyper,
            self._loss_key,
            *signature(callargs, self._device_type, True, aligned_key),
        )

    # ----------------------------------------------------------------- eager (the twin)
    def _body(self, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """One micro-batch, and the optimizer step after the last: the twin's code and the recorded code."""
        dtype = _PRECISIONS[self.precision]
        ctx = (
            torch.autocast(self.device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            loss = self.loss_fn(self.model, *args, **kwargs)
        if (
            self._walking
        ):  # the recording call: does the loss reach parameters we do not hand gradients to?
            self._foreign = foreign_leaves([loss], self.params)
        scaled = loss / self.accumulate if self.accumulate > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if phase in ("step", "last"):
            if self.max_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                params = [p for p in self._trainable if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(
                    params, self.max_norm, foreach=True, error_if_nonfinite=False
                )
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _eager(self, phase: str, reason: str | None, args: tuple, kwargs: dict) -> torch.Tensor:
        if reason is not None:
            self.lifecycle.eager(self._calls, reason)
        stream = _side_stream(self.device) if reason == "warmup" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            loss = self._body(phase, args, kwargs)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
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
        return self._record_call(phase, key, callargs, args, kwargs)

    def _after(self, phase: str, rec: StepRecording) -> torch.Tensor:
        """Leave the gradients as eager would and hand back a copy of the loss."""
        if phase == "step":  # gradients were None before and the replay assigns none
            self._stepped()
        elif phase == "last":  # zero_grad(set_to_none=True) ran in Python at capture only
            self._stepped()
            for p, g in zip(self._trainable, rec.grads_out, strict=True):
                p.grad = g
        else:  # between micro-batches eager's .grad holds the running sum: fresh aliases of the static buffers
            handed = []
            for p, g in zip(self._trainable, rec.grads_out, strict=True):
                if g is None:
                    p.grad = None
                else:
                    self._track(g)
                    alias = g.detach()
                    p.grad = alias
                    handed.append(alias)
            self._handed += handed
        return rec.loss.clone()

    def _track(self, g: torch.Tensor) -> None:
        """A static gradient storage about to be handed out for the first time (at its recording
        call: nobody but the recordings holds it yet): its use count then is its baseline."""
        cdata = g.untyped_storage()._cdata
        if cdata not in self._storages:
            self._storages.append(cdata)
            self._baseline.append(_use_count(cdata))

    def _live_alias(self) -> bool:
        """After copy-out: whether something else still shares a static gradient storage (a view,
        ``.detach()`` or ``.data`` of a handed-out gradient, which copy-out cannot reach)."""
        return any(map(operator.gt, map(_use_count, self._storages), self._baseline))

    def _copy_out(self, call: int) -> None:
        """Before a first phase overwrites the gradient buffers, a handed-out alias still held gets its own storage.

        Eager's next micro-batch makes new gradients and leaves the old ones with their holders.
        """
        handed, self._handed = self._handed, []
        if "copy_out" in self.disabled:
            return
        held = [
            a for a in handed if sys.getrefcount(a) > 3
        ]  # the list, the loop variable, getrefcount's argument
        if held:
            with torch.no_grad():
                for a in held:
                    a.data = a.clone()
            self.journal.add("copy_out", call, None, f"{len(held)} tensors")

    def _hooks(self) -> bool:
        """Hooks run Python a replay skips: the optimizer's and global module hooks are read every
        call; module and parameter hooks only when a watched write happened."""
        if optimizer_hooks(self._opt) or any(GLOBAL_HOOKS):
            return True
        now = guard_epoch()
        if now != self._hooks_epoch:
            self._hooks_epoch = now
            self._has_hooks = gradient_hooks(self._trainable) > 0 or module_hooks(self.model) > 0
        return self._has_hooks

    def _retire(self, reason: str, call: int) -> None:
        self.lifecycle.retire(reason, call)

    def _retire_eager(self, reason: str, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        self._retire(reason, self._calls)
        return self._eager(phase, "retired", args, kwargs)

    def retire(self, reason: str = "retired by the user") -> None:
        """Run eagerly for good: recordings are freed; training goes on with the twin's body."""
        self.lifecycle.retire(reason, self._calls, user=True)

    def release(self) -> None:
        """Free every recording; later calls run the twin's body (reason ``released``). Not a retirement."""
        self.lifecycle.release(self._calls)
        if self._pool is not None:
            self._pool.leave(self)

    def _drop_recordings(self) -> None:
        """The lifecycle's drop (re-record, retire, release): free every recording; parameters and
        the optimizer's refusal are read again (a re-record may follow ``add_param_group``)."""
        for rec in self._recordings.values():
            rec.region.free()
        self._recordings.clear()
        if self.backend is not None:  # None: the eager twin (replay=False)
            self.backend.free()
        self._refused.clear()
        self._storages, self._baseline = [], []
        self._handed = []
        if not self.lifecycle.stopped():
            self._find_params()


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
