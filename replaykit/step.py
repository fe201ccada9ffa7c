"""Whole-step replay: forward, loss, backward and the optimizer step, recorded and replayed.

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

- the model's host values and parameter identity (:class:`~replaykit.guards.ModuleGuard`),
  storages (:class:`~replaykit.retirement.ModuleWatch`), the optimizer's, scaler's and
  clip's host values and state tensors (:mod:`replaykit.step_guards`), the batch's
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
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .backends import module_device
from .backends.region import CudaRegion, Region, TapeRegion
from .errors import ReplayError
from .guards import ModuleGuard, gradient_hooks, held_values, listen_for_writes, value_key
from .guards import epoch as guard_epoch
from .journal import Journal
from .recorder import _copy_into, _host_dependent, recorder_of
from .retirement import ModuleWatch
from .signature import ALIGNMENT, UnhashableArgument, aligned_key, alignment, signature, split_call
from .state import StateSnapshot
from .step_guards import (
    GRAD,
    OptimizerWatch,
    hyper_key,
    optimizer_hooks,
    refusal,
    state_tensors,
    tensors_of,
)

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_use_count = torch._C._storage_Use_Count
_PRECISIONS = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class EMA:
    """An exponential moving average of a model's parameters, updated by one foreach lerp.

    The decay lives on the device (``set_decay`` writes it in place), so a replayed step
    reads the current value; a Python float would be frozen into the graph.
    """

    #: assigning one of these moves ``version``: a recorded step reads the tensors it held then
    _WATCHED = frozenset({"source", "params", "weights", "_weights"})

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.version = 0
        self.source = [p for p in model.parameters()]
        self.params = [p.detach().clone() for p in self.source]
        self._weights: dict[tuple, torch.Tensor] = {}
        for p in self.params:
            self._weights.setdefault((p.dtype, p.device), torch.zeros((), dtype=p.dtype, device=p.device))
        self.weights = [self._weights[(p.dtype, p.device)] for p in self.params]
        self.set_decay(decay)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("source", "params", "weights") and isinstance(value, list):
            value = tuple(value)  # no item assignment: a replaced tensor goes through here
        object.__setattr__(self, name, value)
        if name in EMA._WATCHED:
            object.__setattr__(self, "version", self.version + 1)

    def set_decay(self, decay: float) -> None:
        for w in self._weights.values():
            w.fill_(1.0 - decay)

    def update(self) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(self.params, self.source, self.weights)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self._weights.values()]


class _Recording:
    """One phase of one signature: its region, static inputs and loss, and the gradients it leaves."""

    __slots__ = ("grads_out", "keep", "loss", "region", "static_inputs")

    def __init__(self, region: Region, static_inputs: list[torch.Tensor], loss: torch.Tensor, grads_out: list, keep: list) -> None:
        self.region = region
        self.static_inputs = static_inputs
        self.loss = loss
        self.grads_out = grads_out  # per parameter: the static gradient storage after this phase, or None
        self.keep = keep  # what the key names by id (incoming gradients, tensor hyperparameters): kept alive


class TrainStep:
    """A training step (forward, loss, backward, optimizer) replayed from graphs; see the module docstring."""

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
        strict: bool = False,
        unsafe_disable: tuple[str, ...] = (),
        on_optimizer_step: Callable[[], None] | None = None,
    ) -> None:
        if accumulate < 1:
            raise ReplayError(f"accumulate must be >= 1, got {accumulate}")
        if precision not in _PRECISIONS:
            raise ReplayError(f"precision {precision!r}: choose from {list(_PRECISIONS)}")
        if recorder_of(model) is not None:
            raise ReplayError("the model is captured by rk.capture already: a whole step records it itself")
        unknown = set(unsafe_disable) - set(STEP_PROTECTIONS)
        if unknown:
            raise ReplayError(f"unknown protections {sorted(unknown)}; choose from {list(STEP_PROTECTIONS)}")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.scaler, self.max_norm, self.ema = scaler, max_norm, ema
        self.accumulate, self.precision, self.replay = accumulate, precision, replay
        self.warmup, self.max_recordings, self.strict = warmup, max_recordings, strict
        self.disabled = frozenset(unsafe_disable)
        self.on_optimizer_step = on_optimizer_step  # Python run after every optimizer step (a replay runs none)
        self.device = module_device(model) or torch.device("cpu")
        self.backend = ("cuda" if self.device.type == "cuda" else "emulated") if backend == "auto" else backend
        if self.backend not in ("cuda", "emulated"):
            raise ReplayError(f"unknown backend {backend!r}; choose from ['auto', 'cuda', 'emulated']")
        self.journal = Journal()
        self.retired, self.retire_reason = False, None
        self.params = _unique([*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])])
        self._rg_keys: dict[tuple[bool, ...], int] = {}
        self._rg: tuple[bool, ...] = ()
        self._rg_key = 0
        self._trainable: list[nn.Parameter] = []
        self._refresh_trainable()
        self._calls = 0
        self._micro = 0  # micro-batches into the current optimizer step
        self._steps = 0  # optimizer steps taken (eager or replayed)
        self._recordings: dict[tuple, _Recording] = {}
        self._handed: list[torch.Tensor] = []  # gradient aliases handed out since the last first phase
        # static gradient storages handed out: their use count with no holder but the recordings
        self._storages: list[int] = []
        self._baseline: list[int] = []
        self._pool = torch.cuda.graph_pool_handle() if self.backend == "cuda" else None
        self._refusal = refusal(optimizer, scaler, self.device)
        self._guard = ModuleGuard(model) if replay else None
        self._watch = ModuleWatch(model) if replay else None
        self._owatch: OptimizerWatch | None = None
        self._owner: int | None = None
        self._hooks_epoch, self._has_hooks = -1, False
        for name in sorted(self.disabled):
            self.journal.add("unsafe", 0, name)

    # ----------------------------------------------------------------- read-outs
    @property
    def counts(self) -> dict[str, int]:
        kinds = ("record", "replay", "eager", "retire", "copy_out")
        return {k: self.journal.counts.get(k, 0) for k in kinds}

    @property
    def eager_reasons(self) -> Counter[str]:
        return Counter(self.journal.eager_reasons)

    @property
    def recordings(self) -> int:
        return len(self._recordings)

    def __repr__(self) -> str:
        state = f"retired: {self.retire_reason}" if self.retired else f"{self.recordings} recordings"
        mode = self.backend if self.replay else "eager twin"
        return f"<TrainStep {type(self.model).__name__} {mode} {state} {self.counts}>"

    # ----------------------------------------------------------------- the call
    def _phase(self) -> str:
        if self.accumulate == 1:
            return "step"
        if self._micro == 1:
            return "first"
        return "last" if self._micro == self.accumulate else "accumulate"

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
        self._micro = self._micro % self.accumulate + 1
        phase = self._phase()
        if not self.replay:
            return self._eager(phase, None, args, kwargs)
        return self._route(phase, args, kwargs)

    def _route(self, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        call = self._calls
        if self.retired:
            return self._eager(phase, "retired", args, kwargs)
        if self._refusal is not None:
            return self._eager(phase, self._refusal, args, kwargs)
        if self._steps < self.warmup:
            return self._eager(phase, "warmup", args, kwargs)
        if self._owner != threading.get_ident() and not self._adopt_thread():
            return self._eager(phase, "thread", args, kwargs)
        if not torch.is_grad_enabled():
            return self._eager(phase, "no_grad", args, kwargs)
        if optimizer_hooks(self.optimizer) or self._gradient_hooks():
            return self._eager(phase, "hooks", args, kwargs)
        verdict = self._guard.verdict()  # type: ignore[union-attr]
        if not self._recordings and verdict.retire:
            self._guard.rebaseline()  # type: ignore[union-attr]
            verdict = self._guard.verdict()  # type: ignore[union-attr]
        if verdict.retire is not None and "param_identity" not in self.disabled:
            return self._retire_eager(verdict.retire, phase, args, kwargs)
        if verdict.eager is not None and "param_identity" not in self.disabled:
            return self._eager(phase, verdict.eager, args, kwargs)
        if self._recordings and "state_identity" not in self.disabled:
            changed = self._watch.reason() or self._owatch.reason()  # type: ignore[union-attr]
            if changed is not None:
                return self._retire_eager(changed, phase, args, kwargs)
        try:
            callargs = split_call(args, kwargs)
            key = self._key(phase, verdict.key, callargs)
        except UnhashableArgument as exc:
            return self._eager(phase, exc.reason, args, kwargs)
        if any(map(_REQUIRES_GRAD, callargs.tensors)):  # eager's backward gives it a .grad; a static copy none
            return self._eager(phase, "input_requires_grad", args, kwargs)
        rec = self._recordings.get(key)
        if rec is None:
            if len(self._recordings) >= self.max_recordings:
                return self._eager(phase, "budget", args, kwargs)
            return self._record(phase, key, callargs, args, kwargs)
        if phase == "first":
            self._copy_out(call)
            if "copy_out" not in self.disabled and self._live_alias():
                return self._eager(phase, "live_alias", args, kwargs)
        for static, x in zip(rec.static_inputs, callargs.tensors, strict=True):
            _copy_into(static, x)
        rec.region.replay()
        self.journal.add("replay", call, phase)
        return self._after(phase, rec)

    def _key(self, phase: str, state: Any, callargs: Any) -> tuple:
        grads = list(map(GRAD, self._trainable))
        incoming = 0 if grads.count(None) == len(grads) else tuple(0 if g is None else g.data_ptr() for g in grads)
        if "host_values" in self.disabled:
            hyper: tuple = ()
        else:
            extra = (None if self.max_norm is None else float(self.max_norm).hex(), _scaler_key(self.scaler))
            hyper = hyper_key(self.optimizer, extra)
        if "module_state" in self.disabled:
            state = None
        return (phase, state, self._rg_key, incoming, hyper, *signature(callargs, self.device.type, True, aligned_key))

    def _adopt_thread(self) -> bool:
        if self._owner is None:
            self._owner = threading.get_ident()
        return self._owner == threading.get_ident()

    # ----------------------------------------------------------------- eager (the twin)
    def _body(self, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """One micro-batch, and the optimizer step after the last: the twin's code and the recorded code."""
        dtype = _PRECISIONS[self.precision]
        ctx = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with ctx:
            loss = self.loss_fn(self.model, *args, **kwargs)
        scaled = loss / self.accumulate if self.accumulate > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if phase in ("step", "last"):
            if self.max_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                params = [p for p in self._trainable if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, self.max_norm, foreach=True, error_if_nonfinite=False)
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
            if self.strict and reason not in ("warmup",):
                raise ReplayError(f"replaykit: call {self._calls} would run eagerly: {reason}")
            self.journal.add("eager", self._calls, reason)
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
    def _record(self, phase: str, key: tuple, callargs: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        call = self._calls
        before = list(map(_use_count, self._storages))  # a recording adds holders of its own (private aliases)
        frozen = _host_dependent(self.model)
        if frozen is not None:
            return self._retire_eager(frozen, phase, args, kwargs)
        if not self._recordings:
            self._watch.rebaseline()  # type: ignore[union-attr]
            extra = self.ema.tensors() if self.ema is not None else ()
            self._owatch = OptimizerWatch(self.optimizer, self.scaler, extra, self.ema)
        # one static copy per distinct tensor: step(x, x) keeps `a is b` (nn.MultiheadAttention's
        # self-attention path) inside the recording, as the key's aliasing pattern says
        copies: dict[int, torch.Tensor] = {}
        static = [copies[id(t)] if id(t) in copies else copies.setdefault(id(t), aligned_copy(t)) for t in callargs.tensors]
        incoming = list(map(GRAD, self._trainable))
        # the recording reads private aliases of the incoming gradients: a handed-out alias
        # given storage of its own later (copy-out) must not move what the recording reads
        private = [None if g is None else g.detach() for g in incoming]
        for p, g in zip(self._trainable, private, strict=True):
            p.grad = g
        region: Region = CudaRegion(self.device, self._pool) if self.backend == "cuda" else TapeRegion(static)
        snapshot = _Snapshot(self) if self.backend == "emulated" else None  # the tape runs the body
        scaler_state = _scaler_state(self.scaler)

        def body() -> list[torch.Tensor]:
            a, kw = callargs.rebuild(static)
            return [self._body(phase, a, kw)]

        versions = [t._version for t in static]
        held = held_values(self.model)
        attrs = {id(m): dict(m.__dict__) for m in self.model.modules()}  # CUDA: put back if the capture fails
        try:
            with listen_for_writes() as writes:
                (loss,) = region.capture(body)
        except Exception as exc:
            if snapshot is not None:
                snapshot.restore()  # the twin's body runs this micro-batch again, the forward's Python included
            else:  # a capture executes no kernels: only the forward's Python ran
                from .backends.cuda import end_failed_capture

                end_failed_capture(self.device)
                _restore_attributes(writes, attrs)
            for p, g in zip(self._trainable, incoming, strict=True):
                p.grad = g
            _restore_scaler(self.scaler, scaler_state)
            self._micro -= 1  # the twin's body runs this micro-batch again from the start
            self._calls -= 1
            self._retire(f"capture failed: {type(exc).__name__}: {exc}", call)
            return self(*args, **kwargs)
        grads_out = [None if p.grad is None else p.grad for p in self._trainable]
        keep = [*(g for g in private if g is not None), *tensors_of(self.optimizer)]
        rec = _Recording(region, static, loss, grads_out, keep)
        why = self._unrepeatable(writes, held, static, versions)
        if why is not None:
            # the body ran once, as eager's does: its effects stand (an input written in place
            # reaches the caller's tensor); the recording is not kept
            with torch.no_grad():
                for x, t, v in zip(callargs.tensors, static, versions, strict=True):
                    if t._version != v:
                        x.copy_(t)
            out = self._after(phase, rec)
            region.free()
            self._retire(why, call)
            return out
        self._recordings[key] = rec
        self.journal.add("record", call, phase, f"recording {len(self._recordings)}")
        after = map(_use_count, self._storages)
        self._baseline = [b + a - c for b, a, c in zip(self._baseline, after, before, strict=True)]
        return self._after(phase, rec)

    def _unrepeatable(self, writes: list, held: list, static: list[torch.Tensor], versions: list[int]) -> str | None:
        """What the recorded body did that a replay, running no Python, would not repeat."""
        names = {id(m): n or type(m).__name__ for n, m in self.model.named_modules()}
        written = sorted({f"{names.get(id(m), type(m).__name__)}.{attr}" for m, attr in writes})
        if written:
            return f"the step assigns {', '.join(written)}; a replay would not repeat the assignment"
        mutated = [i for i, (t, v) in enumerate(zip(static, versions, strict=True)) if t._version != v]
        if mutated:
            return f"loss_fn writes input {mutated[0]} in place; a replay would write its own copy"
        changed = [name for name, value, k in held if value_key(value) != k]
        if changed:
            return f"the step changes {changed[0]} (a container or object the model holds); a replay would not"
        return None

    def _after(self, phase: str, rec: _Recording) -> torch.Tensor:
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
        held = [a for a in handed if sys.getrefcount(a) > 3]  # the list, the loop variable, getrefcount's argument
        if held:
            with torch.no_grad():
                for a in held:
                    a.data = a.clone()
            self.journal.add("copy_out", call, None, f"{len(held)} tensors")

    def _gradient_hooks(self) -> bool:
        """Hooks on parameters run Python a replay skips; re-read only when a watched write happened."""
        now = guard_epoch()
        if now != self._hooks_epoch:
            self._hooks_epoch, self._has_hooks = now, gradient_hooks(self._trainable) > 0
        return self._has_hooks

    def _retire(self, reason: str, call: int) -> None:
        self.retired, self.retire_reason = True, reason
        self.journal.add("retire", call, reason)
        self.release()

    def _retire_eager(self, reason: str, phase: str, args: tuple, kwargs: dict) -> torch.Tensor:
        self._retire(reason, self._calls)
        return self._eager(phase, "retired", args, kwargs)

    def release(self) -> None:
        """Free every recording (the step runs eagerly from now on if not retired already)."""
        for rec in self._recordings.values():
            rec.region.free()
        self._recordings.clear()
        self._storages, self._baseline = [], []
        if not self.retired:
            self.retired, self.retire_reason = True, "released"


#: What a TrainStep's ``unsafe_disable`` may switch off (each has a test that diverges without it).
STEP_PROTECTIONS = ("module_state", "param_identity", "state_identity", "host_values", "copy_out")


def _restore_attributes(writes: list[tuple[nn.Module, str]], attrs: dict[int, dict]) -> None:
    """Plain module attributes assigned by a failed CUDA capture's body get their values back
    (the emulated path's StateSnapshot does this and more; kept apart until the H200 runs it)."""
    for m, name in reversed(writes):
        old = attrs.get(id(m))
        if old is None:
            continue
        if name in old:
            m.__dict__[name] = old[name]
        elif name in m.__dict__:
            del m.__dict__[name]


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _scaler_key(scaler: Any) -> Any:
    if scaler is None or not scaler.is_enabled():  # a disabled scaler has no growth settings (nor state)
        return None if scaler is None else False
    return (True, float(scaler._growth_factor).hex(), float(scaler._backoff_factor).hex(), scaler._growth_interval)


def _scaler_state(scaler: Any) -> Any:
    return None if scaler is None or not scaler.is_enabled() else dict(scaler._per_optimizer_states)


def _restore_scaler(scaler: Any, state: Any) -> None:
    if state is not None:
        scaler._per_optimizer_states.clear()
        scaler._per_optimizer_states.update(state)


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


class _Snapshot:
    """What a failed recording may have changed, put back in place: the model's values, ``.grad``,
    RNG and plain attributes (:class:`~replaykit.state.StateSnapshot`, as network replay uses) and
    the optimizer's, scaler's and EMA's state tensors (the emulated backend runs the body)."""

    def __init__(self, step: TrainStep) -> None:
        self._model = StateSnapshot(step.model)
        extra = step.ema.tensors() if step.ema is not None else ()
        tensors = _unique(state_tensors(step.optimizer, step.scaler, extra))
        self._values = [(t, t.detach().clone()) for t in tensors]

    def restore(self) -> None:
        self._model.restore()
        with torch.no_grad():
            for t, v in self._values:
                t.data.copy_(v)


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A private copy of ``t`` with its sizes, strides and address alignment (broadcast dimensions kept).

    Not its storage offset: a batch sliced at offset ``i * n`` from a preloaded dataset would
    otherwise need a buffer as large as the dataset's prefix and a recording per offset.
    """
    t = t.detach()
    item = t.element_size()
    compact = [1 if st == 0 else sz for sz, st in zip(t.shape, t.stride(), strict=True)]
    extent = sum((n - 1) * st for n, st in zip(compact, t.stride(), strict=True)) + 1 if t.numel() else 0
    align = ALIGNMENT.get(t.device.type, 512)
    storage = torch.empty(extent + align // item, dtype=t.dtype, device=t.device)
    want = alignment(t)
    offset = ((want - storage.data_ptr()) % align) // item
    static = storage.as_strided(t.shape, t.stride(), offset)
    if alignment(static) != want:  # an address not a multiple of the element size
        raise ReplayError(f"an input at address {t.data_ptr():#x} is not aligned to its element size")
    _copy_into(static, t)
    return static
