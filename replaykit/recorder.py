"""The recorder: routes every call of a captured module to record, replay, or eager with a reason."""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils.stateless import _reparametrize_module

from .backends import Backend, Recording, module_device, resolve_backend
from .copy_out import StaticAliases
from .errors import ReplayError, ReplayWarning
from .hold import Hold, PendingBackward
from .journal import Journal
from .protections import disabled_protections
from .retirement import ModuleWatch
from .signature import CallArgs, UnhashableArgument, signature, split_call
from .state import StateSnapshot

_RECORDER_ATTR = "_replaykit_recorder"


class _Replay(torch.autograd.Function):
    """Connects one replayed call to autograd: forward replays, backward replays its backward."""

    @staticmethod
    def forward(ctx: Any, step: _Step, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.step = step
        return step.recorder._forward_replay(ctx, step, tensors[: step.n_inputs])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        step: _Step = ctx.step
        return (None, *step.recorder._backward_replay(ctx, step, grads))


class _Step:
    """What one replayed call's autograd node needs to know."""

    __slots__ = (
        "call", "generation", "key", "n_inputs", "pending", "recorder", "recording",
    )

    def __init__(self, recorder: Recorder, recording: Recording, key: tuple, call: int, n_inputs: int) -> None:
        self.recorder = recorder
        self.recording = recording
        self.key = key
        self.call = call
        self.n_inputs = n_inputs
        self.generation = 0
        self.pending: PendingBackward | None = None


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


class Recorder:
    """Records a module's forward+backward per input signature and replays them.

    Made by :func:`replaykit.capture`; see its docstring for the routes and the
    guarantees. Read ``journal``, ``counts``, ``eager_reasons``, ``retired`` and
    ``retire_reason``; call ``retire(reason)`` or ``release()``.
    """

    def __init__(
        self,
        module: nn.Module,
        backend: Backend,
        warmup: int,
        max_recordings: int,
        strict: bool,
        disabled: frozenset[str],
    ) -> None:
        self.module: nn.Module | None = module
        self.module_name = type(module).__name__
        self.backend = backend
        self.warmup = warmup
        self.max_recordings = max_recordings
        self.strict = strict
        self.disabled = disabled
        self.journal = Journal()
        self.retired = False
        self.retire_reason: str | None = None
        self.released = False
        self._device_kind = _device_kind(module, backend)
        self._calls = 0
        self._recordings: dict[tuple, Recording] = {}
        self._guard_grads = "copy_out" not in disabled
        self._guard_outputs = "live_outputs" not in disabled
        self._aliases: dict[tuple, StaticAliases] = {}
        me = weakref.ref(self)  # the hold must not keep its recorder alive (no cycle)
        self._hold = Hold(lambda call, reason: (r := me()) is not None and r._on_release(call, reason))
        self._hold_enabled = "hold" not in disabled
        self._exact_none = "none_pattern" not in disabled
        self._watch = ModuleWatch(module)
        self._free_after_backward = False
        for name in sorted(disabled):
            self.journal.add("unsafe", 0, name)
        self._own_forward = "forward" in module.__dict__
        self._forward = module.forward
        module.forward = _RoutedForward(self, module)
        setattr(module, _RECORDER_ATTR, self)

    # ----------------------------------------------------------------- read-outs
    @property
    def counts(self) -> dict[str, int]:
        """Events by kind, exact however long the run."""
        kinds = ("record", "replay", "eager", "backward", "copy_out", "retire", "release")
        return {k: self.journal.counts.get(k, 0) for k in kinds}

    @property
    def eager_reasons(self) -> Counter[str]:
        """Eager routes by reason, exact however long the run."""
        return Counter(self.journal.eager_reasons)

    @property
    def backward_reasons(self) -> Counter[str]:
        """Backwards run eagerly through the recorded graph, by reason (``partial``, ``layout``, ``capture failed: ...``)."""
        return Counter(self.journal.backward_reasons)

    @property
    def recordings(self) -> int:
        """How many recordings are held now."""
        return len(self._recordings)

    def __deepcopy__(self, memo: dict) -> None:
        """A deep copy of a captured module is a plain module: it gets no recorder."""
        return None

    def __repr__(self) -> str:
        state = f"retired: {self.retire_reason}" if self.retired else f"{self.recordings} recordings"
        return f"<Recorder {self.module_name} backend={self.backend.name} {state} {self.counts}>"

    # ----------------------------------------------------------------- routing
    def _route(self, args: tuple, kwargs: dict) -> Any:
        self._calls += 1
        call = self._calls
        if self.retired:
            return self._eager(call, "retired", args, kwargs)
        if not torch.is_grad_enabled():
            return self._eager(call, "no_grad", args, kwargs)
        if not self.module.training:
            return self._eager(call, "eval", args, kwargs)
        if self._hold_enabled and self._hold.active:
            return self._eager(call, "hold", args, kwargs)
        if self._recordings:
            changed = self._watch.reason()
            if changed is not None:
                self._retire(changed, call)
                return self._eager(call, "retired", args, kwargs)
        try:
            callargs = split_call(args, kwargs)
            key = signature(callargs, self._device_kind)
        except UnhashableArgument:
            return self._eager(call, "unhashable_argument", args, kwargs)
        recording = self._recordings.get(key)
        if recording is None:
            if len(self._recordings) >= self.max_recordings:
                return self._eager(call, "budget", args, kwargs)
            if not self._copy_out(call):
                return self._eager(call, "live_alias", args, kwargs)
            recording = self._record(call, callargs, key)
            if recording is None:
                return self._eager(call, "retired", args, kwargs)
        else:
            if not self._copy_out(call):
                return self._eager(call, "live_alias", args, kwargs)
            self.journal.add("replay", call)
        return self._replay(call, recording, key, callargs)

    def _eager(self, call: int, reason: str, args: tuple, kwargs: dict) -> Any:
        if self.strict:
            why = f"recorder is retired ({self.retire_reason})" if reason == "retired" else f"call {call} would run eagerly: {reason}"
            raise ReplayError(f"replaykit: {why}")
        self.journal.add("eager", call, reason)
        return self._forward(*args, **kwargs)

    def _run_forward(
        self, callargs: CallArgs, names: list[str], *tensors: torch.Tensor, params: list[torch.Tensor] | None = None
    ) -> Any:
        """The module's own forward on ``tensors``; with ``params``, those stand in for the parameters."""
        args, kwargs = callargs.rebuild(tensors)
        if params is None:
            return self._forward(*args, **kwargs)
        with _reparametrize_module(self.module, dict(zip(names, params, strict=True)), tie_weights=True):
            return self._forward(*args, **kwargs)

    def _record(self, call: int, callargs: CallArgs, key: tuple) -> Recording | None:
        if not self._recordings:
            self._watch.rebaseline()
        if self._watch.hooks_at_start:
            self._retire("module hooks inside the module would not run under replay", call)
            return None
        frozen = _host_dependent(self.module)
        if frozen is not None:  # refused on both backends: the emulated one mirrors what a graph can do
            self._retire(frozen, call)
            return None
        snapshot = StateSnapshot(self.module)
        static_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in callargs.tensors]
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        fn = partial(self._run_forward, callargs, [n for n, _ in named])
        try:
            recording = self.backend.record(fn, static_inputs, params, self.warmup)
        except Exception as exc:
            snapshot.restore()
            self._retire(f"capture failed: {type(exc).__name__}: {exc}", call, cause=exc)
            return None
        snapshot.restore()
        self._recordings[key] = recording
        self._aliases[key] = StaticAliases(recording.static_outputs if self._guard_outputs else (), ())
        self._guard_new_grads(key, recording)
        shapes = ", ".join("x".join(map(str, t.shape)) for t in callargs.tensors)
        self.journal.add("record", call, None, f"[{shapes}] recording {len(self._recordings)}")
        return recording

    def _guard_new_grads(self, key: tuple, recording: Recording) -> None:
        """Put static gradient buffers a recording has (now) under copy-out."""
        if not self._guard_grads:
            return
        params = recording.params
        grads = recording.static_grads[len(recording.static_grads) - len(params) :]
        self._aliases[key].add_grads([(p, g) for p, g in zip(params, grads, strict=True) if g is not None])

    def _replay(self, call: int, recording: Recording, key: tuple, callargs: CallArgs) -> Any:
        step = _Step(self, recording, key, call, len(callargs.tensors))
        outputs = _Replay.apply(step, *callargs.tensors, *recording.params)
        self._aliases[key].handed_out(outputs)
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

    def _forward_replay(self, ctx: Any, step: _Step, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        recording = step.recording
        for static, x in zip(recording.static_inputs, inputs, strict=True):
            static.data.copy_(x)  # like a graph's own writes: no autograd version bump
        recording.replay_forward()
        step.generation = recording.generation
        if self._hold_enabled:
            # ctx (and so step) lives exactly as long as the pending autograd graph
            step.pending = self._hold.begin(step.call)
        outputs = tuple([o.detach() for o in recording.static_outputs])
        if recording.frozen_outputs:
            ctx.mark_non_differentiable(*[outputs[i] for i in recording.frozen_outputs])
        return outputs

    def _backward_replay(
        self, ctx: Any, step: _Step, grads: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        recording = step.recording
        if step.pending is not None:
            self._hold.release(step.pending, "backward")
            step.pending = None
        if not recording.static_inputs:
            raise ReplayError("replaykit: the recording was freed before this backward ran")
        if self._hold_enabled and recording.generation != step.generation:
            raise ReplayError(
                f"replaykit: backward of call {step.call} after a later replay overwrote its activations "
                "(a retained graph differentiated twice across replays)"
            )
        wanted = [grads[i] for i in recording.differentiable]
        if not self._exact_none:  # unsafe: unread outputs get zeros, as plain CUDA graphs do
            wanted = [
                torch.zeros_like(recording.static_outputs[i]) if g is None else g
                for i, g in zip(recording.differentiable, wanted, strict=True)
            ]
        if recording.prepare_backward(wanted):  # a backward graph was captured: its buffers join copy-out
            self._guard_new_grads(step.key, recording)
        result, how = recording.backward(wanted)
        if how is None:
            self._aliases[step.key].handed_out()
        else:
            self.journal.add("backward", step.call, how)
        # input gradients leave as copies: their holders (x.grad of a new x each call) are unreachable
        it = iter(result)
        needs = recording.inputs_requiring_grad
        result = [(None if (g := next(it)) is None else g.clone()) if req else None for req in needs] + list(it)
        if self._free_after_backward:
            self._free_recordings()
        return result

    def _on_release(self, call: int, reason: str) -> None:
        self.journal.add("release", call, reason)
        if self._free_after_backward and reason == "dropped":
            self._free_recordings()

    # ----------------------------------------------------------------- retirement
    def _retire(self, reason: str, call: int, cause: BaseException | None = None, user: bool = False) -> None:
        if self.retired:
            return
        if self.strict and not user:
            raise ReplayError(f"replaykit: recorder would retire: {reason}") from cause
        self.retired = True
        self.retire_reason = reason
        self.journal.add("retire", call, reason)
        warnings.warn(
            f"replaykit: {self.module_name} recorder retired to eager: {reason}",
            ReplayWarning,
            stacklevel=4,
        )
        self._watch.close()
        if self._hold.active:
            self._free_after_backward = True  # the pending backward still needs its recording
        else:
            self._free_recordings()

    def _free_recordings(self) -> None:
        for aliases in self._aliases.values():
            aliases.copy_out()  # reachable holders keep valid values without pinning static memory
        self._aliases.clear()
        for recording in self._recordings.values():
            recording.free()
        self._recordings.clear()
        self.backend.free()
        self._free_after_backward = False

    def retire(self, reason: str = "retired by the user") -> None:
        """Switch to eager for good: graphs and static memory are freed; training goes on eagerly."""
        self._retire(reason, self._calls, user=True)

    def release(self) -> None:
        """Restore ``module.forward`` and free everything; safe to call twice."""
        if self.released:
            return
        self.released = True
        if not self.retired:
            self.retired = True
            self.retire_reason = "released"
        self._watch.close()
        self._hold.clear()
        self._free_recordings()
        module = self.module
        assert module is not None
        if self._own_forward:
            module.forward = self._forward
        else:
            module.__dict__.pop("forward", None)
        module.__dict__.pop(_RECORDER_ATTR, None)
        self.module = None  # a released recorder keeps its journal, not the module
        self._forward = None
        self.journal.add("release", self._calls, "recorder")

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _host_dependent(module: nn.Module) -> str | None:
    """Why a graph would freeze a host-side value of this module, or None.

    BatchNorm with ``momentum=None`` averages with ``1 / num_batches_tracked`` read on the
    host at every call; a graph would replay the first call's factor for ever.
    """
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.track_running_stats:
            return f"BatchNorm {name or type(m).__name__} with momentum=None reads a host-side counter every call"
    return None


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
    unsafe_disable: tuple[str, ...] | list[str] | str = (),
) -> Recorder:
    """Route every call of ``module`` through a recorder: record, replay, or eager with a reason.

    - A call in training mode with grad enabled and no replay backward pending records
      its signature (shapes, dtypes, strides, devices, requires_grad, non-tensor
      arguments, autocast state) while ``max_recordings`` lasts, then replays it.
    - Otherwise it runs eagerly, with the reason in the journal: ``no_grad``, ``eval``,
      ``hold``, ``budget``, ``unhashable_argument``, ``retired``.
    - Replays end bitwise equal to eager training: live gradients and outputs are
      copied out before each replay, the hold keeps a pending backward's activations,
      and parameters behind unread outputs keep ``.grad is None``.
    - Parameter replacement, storage changes, new submodule hooks or a failing capture
      retire the recorder (permanent eager, graphs freed, one warning).

    ``backend`` is ``"cuda"``, ``"emulated"`` or ``"auto"`` (cuda for a module on a CUDA
    device). ``strict=True`` raises :class:`ReplayError` instead of any eager route or
    retirement. ``unsafe_disable`` switches protections off, for diagnosis only.
    Capturing a module that is already captured raises :class:`ReplayError`; release
    the live recorder (see :func:`recorder_of`) first.
    """
    if not isinstance(module, nn.Module):
        raise ReplayError(f"capture() takes an nn.Module, not {type(module).__name__}")
    for name, value in (("warmup", warmup), ("max_recordings", max_recordings)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReplayError(f"{name} must be an int >= 1, got {value!r}")
    if recorder_of(module) is not None:
        raise ReplayError(
            f"{type(module).__name__} is already captured; call release() on its recorder first"
        )
    disabled = disabled_protections(unsafe_disable)
    chosen = resolve_backend(backend, module)
    return Recorder(module, chosen, warmup, max_recordings, bool(strict), disabled)
