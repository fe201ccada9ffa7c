"""torch.compile'd code inside a recording: compiled in warm-up, never while a recording is made.

A recording freezes the kernels dynamo chose when its guards last passed, so:

- **no compilation inside a recording**: a compile inside a CUDA capture runs inductor on a
  capturing stream and would freeze a half-made program. :class:`CompileWatch` listens to
  dynamo's compile callbacks; a compile aborts the recording, the call runs eagerly
  (``compiling``) and the next call records with the code ready. A replay evaluates no dynamo
  guard: what they read is what replaykit keys.
- **no CUDA graphs inside**: ``mode="reduce-overhead"`` or ``backend="cudagraphs"`` replays
  graphs of its own, which cannot be captured into ours (:func:`refuse_cudagraphs`).
- **the emulated tape sees compiled code**: inductor's C++ kernels bypass the dispatcher, so a
  tape would replay stale buffers silently; a compiled frame run while the emulated backend
  records refuses it (protection ``compiled_code``).

``torch._dynamo`` is never imported here: a process without it runs no compiled code.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ..errors import ReplayError

__all__ = [
    "CompileWatch",
    "Recompiled",
    "compiled_regions",
    "refuse_cudagraphs",
    "unwatched_compiled_code",
]


class Recompiled(ReplayError):
    """Dynamo compiled while a recording was made: the recording is dropped and made again later."""


def _dynamo() -> Any:
    """``torch._dynamo`` if the process imported it (compiled code can only run then), else None."""
    return sys.modules.get("torch._dynamo")


def _frames_unwatched(dynamo: Any) -> bool:
    """torch 2.4's dynamo has no guard-complete hook: a compiled frame run is not seen."""
    return not hasattr(dynamo.eval_frame, "set_guard_complete_hook")


def unwatched_compiled_code() -> str | None:
    """Why the emulated tape records nothing while dynamo holds compiled code (its output code
    objects, cleared by ``torch._dynamo.reset()``), where compiled frames cannot be counted
    (torch 2.4), or None. Measured on 2.4.1: a recording over a compiled function recompiled it
    at every attempt, and the run ended unlike eager, silently."""
    dynamo = _dynamo()
    if dynamo is None or not _frames_unwatched(dynamo):
        return None
    if not dynamo.convert_frame.output_codes.seen_ids:
        return None
    return CompileWatch.unseen_reason("torch < 2.5 cannot count its frames")


def compiled_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The compiled modules of a tree: ``torch.compile(module)`` wrappers and ``module.compile()``'d ones."""
    found = []
    for name, m in model.named_modules():
        if type(m).__name__ == "OptimizedModule" or m.__dict__.get("_compiled_call_impl"):
            found.append((name or type(m).__name__, m))
    return found


def _backend_of(m: nn.Module) -> Any:
    """The backend object ``torch.compile`` was given (through dynamo's wrappers), or None."""
    callable_ = m.__dict__.get("_compiled_call_impl")
    ctx = getattr(m, "dynamo_ctx", None) or getattr(callable_, "_torchdynamo_orig_callable", None)
    cb = getattr(ctx, "callback", None)
    seen = 0
    while cb is not None and seen < 8:
        # torch 2.5+ links its wrappers by _torchdynamo_orig_backend, torch 2.4 by _orig_callable
        inner = getattr(cb, "_torchdynamo_orig_backend", None)
        if inner is None:
            inner = getattr(cb, "_torchdynamo_orig_callable", None)
        if inner is None:
            break
        cb, seen = inner, seen + 1
    return cb


def aot_compiled(model: nn.Module) -> str | None:
    """The first compiled module whose backend goes through AOT autograd (inductor, the default;
    ``aot_eager``), whose compiled backward donates its buffers and so cannot run twice; None
    when every compiled module's backend is dynamo's plain ``eager``."""
    for name, m in compiled_regions(model):
        if getattr(_backend_of(m), "compiler_name", None) != "eager":
            return name
    return None


def _uses_cudagraphs(m: nn.Module) -> bool:
    backend = _backend_of(m)
    if getattr(backend, "compiler_name", None) == "cudagraphs":
        return True
    config = getattr(backend, "config", None)
    if isinstance(config, dict) and config.get("triton.cudagraphs"):
        return True
    inductor = sys.modules.get("torch._inductor.config")
    return bool(inductor is not None and inductor.triton.cudagraphs)


def refuse_cudagraphs(model: nn.Module, entry: str) -> None:
    """A compiled module that replays CUDA graphs of its own cannot be recorded into ours."""
    for name, m in compiled_regions(model):
        if _uses_cudagraphs(m):
            raise ReplayError(
                f"{entry}: {name} is compiled with CUDA graphs of its own (mode='reduce-overhead', "
                "backend='cudagraphs' or triton.cudagraphs); replaykit records the step into one graph: "
                "compile with the default mode (torch.compile(model)) and let replaykit do the graphs"
            )


class CompileWatch:
    """While a recording is made: whether dynamo started a compilation, and (``frames=True``, the
    emulated backend) how many compiled frames ran. Re-entrant use is not needed: one recording
    at a time per entry point, under its lock."""

    __slots__ = (
        "_hook",
        "_previous",
        "_start",
        "blind",
        "compiles",
        "frames",
        "refuse_frames",
        "watch_frames",
    )

    def __init__(self, frames: bool, refuse_frames: bool = True) -> None:
        self.watch_frames = frames
        self.refuse_frames = refuse_frames
        self.compiles: list[str] = []
        self.frames = 0
        self._start: Any = None
        self._hook: Any = None
        self._previous: Any = None
        self.blind = False  # frames are to be watched and cannot be (torch 2.4)

    def __enter__(self) -> CompileWatch:
        dynamo = _dynamo()
        if dynamo is None:
            return self
        compiles = self.compiles
        self.blind = self.watch_frames and self.refuse_frames and _frames_unwatched(dynamo)

        def started(args: Any = None) -> None:  # torch 2.4 passes no arguments
            compiles.append(str(getattr(args, "callback_trigger", "compile")).rsplit(".", 1)[-1])

        handler = getattr(dynamo, "callback_handler", None)
        if hasattr(handler, "register_start_callback"):
            handler.register_start_callback(started)
            self._start = started
        set_guard_complete_hook = getattr(dynamo.eval_frame, "set_guard_complete_hook", None)
        if self.watch_frames and set_guard_complete_hook is not None:
            previous = None

            def ran(cache_hit: bool) -> bool:
                self.frames += 1
                return previous(cache_hit) if previous is not None else cache_hit

            previous = set_guard_complete_hook(ran)
            self._previous, self._hook = previous, set_guard_complete_hook
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None:
            _dynamo().callback_handler.remove_start_callback(self._start)
            self._start = None
        if self._hook is not None:
            self._hook(self._previous)
            self._hook = None

    def check(self) -> None:
        """After the recording: raise if it cannot be kept (compiled frames the tape cannot see, a
        compilation inside it)."""
        unseen = self.unseen() if self.refuse_frames else None
        if unseen is None and self.blind and self.compiles:  # what compiled may run unseen
            unseen = self.unseen_reason("torch < 2.5 cannot count its frames")
        if unseen is not None:
            raise ReplayError(unseen)
        compiling = self.compiling()
        if compiling is not None:
            raise Recompiled(compiling)

    def recompiled(self) -> bool:
        """Whether a failed recording is to be made again (dynamo compiled in it) rather than refused."""
        return bool(self.compiles) and not (self.refuse_frames and self.frames) and not self.blind

    def compiling(self) -> str | None:
        """Why the recording must be made again after an eager call, or None."""
        if not self.compiles:
            return None
        return f"dynamo compiled while recording ({', '.join(self.compiles)}): the call runs eagerly and records next time"

    def unseen(self) -> str | None:
        """Why the emulated tape cannot replay this recording (compiled frames ran in it), or None."""
        return self.unseen_reason(f"{self.frames} frame(s)") if self.frames else None

    @staticmethod
    def unseen_reason(what: str) -> str:
        return (
            f"torch.compile'd code ({what}) runs in the recording: its compiled kernels bypass the dispatcher, "
            "so the emulated tape cannot replay them (on CUDA, a graph captures them); it runs eagerly"
        )
