"""The optimizer step alone, recorded and replayed: clipping, the GradScaler's step and update, the update.

For a loop that keeps its own forward and backward (Lightning's automatic optimization)::

    opt_step = OptimizerStep(optimizer, scaler=scaler)
    loss.backward()
    opt_step(lambda: (clip_grad_norm_(params, 1.0), scaler.step(optimizer), scaler.update()),
             key=("norm", 1.0))

Autograd makes new gradient tensors every step, so a recording reads gradient buffers of its
own: the gradients are copied in before each replay and the clipped or unscaled values back
after it (``grad_inputs``). What it reads by address is read again at every replay; host values
it bakes in (a float ``lr``, ``key``, the scaler's settings) key the recordings; replaced state
re-records. Each new recording is verified once against the body run eagerly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from functools import partial, reduce
from typing import Any

import torch
from torch import nn

from .backends import Region, resolve_backend
from .errors import ReplayError, check_count
from .guards.optimizer import (
    OptimizerWatch,
    host_state,
    hyper_key,
    optimizer_hooks,
    optimizer_refusal,
    scaler_key,
    tensors_of,
)
from .memory.layout import ALIGNMENT, aligned_copy, alignment
from .memory.pool import storage_bytes
from .protections import Switches, disabled_protections
from .route import Entry, signature_of
from .verify.call_state import CallState
from .verify.side_effects import SideEffects
from .verify.step_check import StepSnapshot, difference, end_state, unique

__all__ = ["OptimizerStep"]

_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_IS_NONE = partial(operator.is_, None)
_NO_LOSS = torch.zeros(())  # end_state names a loss; an optimizer step has none


class _Recording:
    """One key's region, its gradient buffers and what its key names by identity (kept alive)."""

    __slots__ = ("grads", "keep", "region")

    def __init__(self, region: Region, grads: list[torch.Tensor], keep: list) -> None:
        self.region, self.grads, self.keep = region, grads, keep


class OptimizerStep(Entry):
    """Replays an optimizer step's body (clip, scaler, update) from graphs; see the module docstring."""

    kind = "OptimizerStep"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        backend: str = "auto",
        warmup: int = 1,
        max_recordings: int = 8,
        max_rerecords: int = 8,
        strict: bool = False,
        trust_optimizer: bool = False,
        unsafe_disable: tuple[str, ...] | list[str] | str = (),
        name: str | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ReplayError(
                f"OptimizerStep takes a torch.optim.Optimizer, not {type(optimizer).__name__}"
            )
        check_count("warmup", warmup, 0)
        check_count("max_recordings", max_recordings, 1)
        check_count("max_rerecords", max_rerecords, 0)
        self.on = Switches(disabled_protections(unsafe_disable, "optimizer_step"))
        self.optimizer, self.scaler = optimizer, scaler
        self.params: list[torch.Tensor] = []
        self._find_params()
        # the lifecycle watches the stepped parameters (storages swapped, .data replaced)
        self._holder = nn.ParameterList([p for p in self.params if isinstance(p, nn.Parameter)])
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.backend = resolve_backend(backend, self._holder)
        self.warmup, self.max_recordings = warmup, max_recordings
        self._trust = bool(trust_optimizer) or not self.on.optimizer_trust
        name = name or f"OptimizerStep({type(optimizer).__name__})"
        self.lifecycle = self._lifecycle(name, self._holder, strict, max_rerecords)
        if self.on.state_identity:
            self.lifecycle.add_watch(OptimizerWatch(optimizer, scaler))
        self._refusal = refusal(optimizer, scaler, self.device, self._trust)
        self._pool = None  # its recordings live in the backend's own pool
        self._recordings: dict[tuple, _Recording] = {}
        self._refused: dict[tuple, str] = {}
        self._calls = 0
        self._steps = 0
        self._align_mask = ALIGNMENT.get(self.device.type, 512) - 1

    def _find_params(self) -> None:
        """The optimizer's parameters (again after a re-record: a group may have been added)."""
        self.params = unique([p for g in self.optimizer.param_groups for p in g["params"]])

    @property
    def refusal(self) -> str | None:
        """Why this optimizer/scaler pair never replays (every call then runs eagerly with it), or None."""
        return self._refusal

    def run_eager(self, body: Callable[[], Any], reason: str) -> None:
        """Run ``body`` eagerly with ``reason`` journaled: the caller knows a replay would be wrong."""
        self._calls += 1
        self._eager(body, reason)

    def _label(self) -> str:
        return f"OptimizerStep {self.backend.name}"

    def _memory_rows(self) -> list[dict[str, Any]]:
        """A recording's only static memory is its gradient buffers."""
        return [
            {
                "signature": signature_of(rec.grads),
                "static_inputs": 0,
                "static_outputs": 0,
                "static_grads": storage_bytes(rec.grads),
            }
            for rec in self._recordings.values()
        ]

    # ----------------------------------------------------------------- the call
    def __call__(self, body: Callable[[], Any], key: tuple[Hashable, ...] = ()) -> None:
        """Run ``body`` (one optimizer step over the current ``.grad``): replayed, recorded or
        eager. ``key``: the host values ``body`` bakes in besides the optimizer's and scaler's own
        (the clip threshold and algorithm); a changed key records anew."""
        self._calls += 1
        call = self._calls
        state, why = self.admit(call)
        if why is None:
            grads = [p.grad for p in self.params]
            present = [g for g in grads if g is not None]
            if not present:
                why = "no gradients"
            else:
                full = self._key(state, key, grads, present)
                rec, why = self.choose(self._recordings, full, call)
        if why is not None:
            with self.held(why):
                return self._eager(body, why)
        if rec is None:
            with self.lifecycle.lock:
                return self._record(body, full, grads)
        grads_in = self.on.grad_inputs
        if grads_in:
            torch._foreach_copy_(rec.grads, present)
        rec.region.replay()
        if grads_in:
            torch._foreach_copy_(present, rec.grads)
        self._steps += 1
        self.journal.tick("replay", call, "optimizer_step")
        return None

    def early_checks(self) -> str | None:
        """An optimizer/scaler pair that never replays, then the warm-up."""
        if self._refusal is not None:
            return self._refusal
        return "warmup" if self._steps < self.warmup else None

    def late_checks(self, call: int) -> str | None:
        """Optimizer hooks run Python a replay skips."""
        return "hooks" if optimizer_hooks(self.optimizer) else None

    def _key(self, state: Any, key: tuple, grads: list, present: list) -> tuple:
        """Host values, the gradients' None pattern and layout (a recording's buffers mirror them).
        Autograd gives a gradient its parameter's shape and dtype; strides and address alignment (a
        view into a bucket) may differ, so they key. Kept to C-level maps: it runs every step."""
        hyper = (
            hyper_key(self.optimizer, (*key, scaler_key(self.scaler)))
            if self.on.host_values
            else ()
        )
        nones = len(grads) - len(present)
        pattern = tuple(map(_IS_NONE, grads)) if nones else None
        misaligned = reduce(operator.or_, map(_PTR, present)) & self._align_mask
        aligned = tuple(map(alignment, present)) if misaligned else 0
        strides = tuple(map(_STRIDE, present))
        return (state, hyper, pattern, strides, aligned)

    def _eager(self, body: Callable[[], Any], reason: str | None) -> None:
        if reason is not None:
            self.lifecycle.eager(self._calls, reason)
        body()
        self._steps += 1

    # ----------------------------------------------------------------- record
    def _record(self, body: Callable[[], Any], key: tuple, grads: list) -> None:
        """The recording call: capture -> judge -> keep over private gradient buffers, under one
        :class:`~replaykit.verify.call_state.CallState` (taken before the capture, restored before
        the one eager run a verification or a refusal makes: the param groups' Python values, an
        inner optimizer's state, the optimizer's own attributes too). The capture's prints are
        held: emitted when its work stands, dropped when an eager run follows."""
        call = self._calls
        frozen = host_state(self.optimizer, self.device)
        if frozen is not None:
            self.lifecycle.retire(frozen, call)
            return self._eager(body, "retired")
        if not self._recordings:
            self.lifecycle.first_record()
        static = [None if g is None else aligned_copy(g) for g in grads]
        buffers = [s for s in static if s is not None]
        for p, s in zip(self.params, static, strict=True):
            p.grad = s
        region = self.backend.region(buffers)
        state = self._call_state()
        kind, why = self._capture_step(region, body, state, static)
        if kind == "eager":  # nothing of the capture stands: the body runs once, eagerly
            region.free()
            state.restore()
            state.stands(None)
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g  # their values before the step: the body runs again, eagerly
            self.lifecycle.retire(why, call)
            return self._eager(body, "retired")
        stands = kind is None and self._judge_step(region, body, state, key)
        if kind == "stands":  # the body ran once, as eager's does; the recording is not kept
            region.free()
            state.stands(state.runs[-1])
            self.lifecycle.retire(why, call)
        self._give_back(grads, static)
        self._steps += 1
        if stands:
            self._recordings[key] = _Recording(region, buffers, tensors_of(self.optimizer))
            self.journal.add("record", call, "optimizer_step", f"recording {len(self._recordings)}")
        return None

    def _call_state(self) -> CallState:
        """What the capture and a verification's eager run may change (``call_state`` off,
        unsafe: the tensor snapshot alone)."""
        snapshot = StepSnapshot(
            self._holder, self.optimizer, self.scaler, None, self.params, tensors=True
        )
        if not self.on.call_state:
            return CallState(snapshot, self._holder, whole=False)
        return CallState(snapshot, self._holder, self.optimizer)

    def _capture_step(
        self, region: Any, body: Callable[[], Any], state: CallState, static: list
    ) -> tuple[str | None, str | None]:
        """The capture (on CUDA it replays once: the step). ``("eager", why)``: nothing of it may
        stand; ``("stands", why)``: its work is the call's, unkept (an effect a replay would not
        repeat); ``(None, None)``: on to the judge."""
        # the body writes its gradient buffers in place by design (clipping, unscaling):
        # ``grad_inputs`` copies them back, so they are not inputs whose writes a replay would lose
        effects = SideEffects(self._holder, (), self.on.host_rng)
        try:
            with effects, state.output().held():
                region.capture(lambda: _run(body))
        except Exception as exc:
            region.abort()
            return "eager", f"capture failed: {type(exc).__name__}: {exc}"
        rebound = (
            [i for i, (p, s) in enumerate(zip(self.params, static, strict=True)) if p.grad is not s]
            if self.on.grad_rebind
            else []
        )
        if rebound:  # the body's new .grad tensors: grad_inputs copies back into the buffers only
            return "eager", (
                f"the optimizer step assigns a new .grad to parameter(s) {rebound[:4]} (e.g. "
                "p.grad = p.grad * s); a replay would leave the gradient it was given"
            )
        why = effects.reason("the optimizer step")
        return ("stands", why) if why is not None else (None, None)

    def _judge_step(
        self, region: Any, body: Callable[[], Any], state: CallState, key: tuple
    ) -> bool:
        """The recording against the body run eagerly from the state put back (that run is the
        call's): a difference refuses the key. Without verification the capture's work stands."""
        call = self._calls
        if not self.on.verify_recording:
            state.stands(state.runs[-1])
            return True
        found = self._against_eager(state, body)
        self.journal.add("check", call, "recording", found)
        if found is None:
            return True
        region.free()
        self._refused[key] = "diverged"  # eager's work stands; this key runs eagerly from now on
        self.journal.add("refuse", call, "diverged", f"the recording differs from eager: {found}")
        return False

    def _against_eager(self, state: CallState, body: Callable[[], Any]) -> str | None:
        """The recorded work's end state against ``body`` run eagerly from the state put back
        (``state``); eager's stays, as the call's one run."""
        now = (self._holder, self.optimizer, self.scaler, None, self.params)
        replayed = end_state(*now, _NO_LOSS, clone=True, extra=state.outside)
        state.restore()
        state.stands(None)
        body()
        return difference(replayed, end_state(*now, _NO_LOSS, clone=False, extra=state.outside))

    def _give_back(self, grads: list, static: list) -> None:
        """The parameters get their own gradient tensors back, with the step's values (clipped, unscaled)."""
        with torch.no_grad():
            for p, g, s in zip(self.params, grads, static, strict=True):
                if g is not None:
                    g.copy_(s)
                p.grad = g

    # ----------------------------------------------------------------- stop (retire, release: Entry)
    def _drop_recordings(self) -> None:
        for rec in self._recordings.values():
            rec.region.free()
        self._recordings.clear()
        self._refused.clear()
        if not self.lifecycle.stopped():
            self._find_params()
            self._refusal = refusal(self.optimizer, self.scaler, self.device, self._trust)


def refusal(
    optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device, trust: bool
) -> str | None:
    """Why this optimizer step can never replay, or None: the whole step's refusals, and a tensor
    ``lr`` kept on the CPU while the parameters live on a GPU (a graph would read it once)."""
    why = optimizer_refusal(optimizer, scaler, device, trust)
    if why is None and device.type == "cuda":
        for lr in tensors_of(optimizer):
            if lr.device.type == "cpu":
                return "a tensor lr on the CPU: a CUDA graph reads it once; create it on the device"
    return why


def _run(body: Callable[[], Any]) -> list[torch.Tensor]:
    """``body`` inside a region: it returns nothing the region hands out."""
    body()
    return []
