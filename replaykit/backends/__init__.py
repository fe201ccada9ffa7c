"""Backends behind one small interface: ``cuda`` (CUDA graphs) and ``emulated`` (any device)."""

from __future__ import annotations

import sys
import warnings

import torch

from ..errors import ReplayError, ReplayWarning
from ..memory.pool import MemoryPool
from .base import Backend, Recording, Region, Subject, capture_failure, known_cause
from .emulated import EmulatedBackend
from .host_feeds import refused_host_copy
from .scratch import Scratch

BACKENDS: tuple[str, ...] = ("auto", "cuda", "emulated")

#: what ``backend="auto"`` says, once per process, when it falls back to the emulated backend
AUTO_ON_CPU = (
    "replaykit: the module is not on a CUDA device, so backend='auto' uses the emulated backend, "
    "which checks replay semantics on the CPU and is slower than eager training; it does not speed "
    "anything up. For speed on a CPU train eagerly (rk.TrainStep(..., replay=False); no rk.capture "
    "or ReplayCallback); pass backend='emulated' to silence this."
)
_CALLERS = frozenset({"replaykit", "lightning", "pytorch_lightning"})
_told_auto_on_cpu = False


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the module's first parameter or buffer (None for a stateless module)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def resolve_backend(name: str, module: torch.nn.Module, pool: MemoryPool | None = None) -> Backend:
    """``auto`` is ``cuda`` for a module on a CUDA device and ``emulated`` otherwise (which it says
    once per process: emulation checks, it is slower than eager); ``pool``: a shared
    :class:`~replaykit.memory.pool.MemoryPool` (None: a private pool of its own)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ReplayError(f"unknown backend {name!r}; choose from {list(BACKENDS)}")
    device = module_device(module)
    if name == "auto":
        name = "cuda" if device is not None and device.type == "cuda" else "emulated"
        if name == "emulated":
            _tell_auto_on_cpu()
    if name == "emulated":
        return EmulatedBackend(pool)
    from .cuda import CudaBackend

    if device is None:
        if not torch.cuda.is_available():
            raise ReplayError("backend='cuda' needs a CUDA GPU, and torch sees none")
        device = torch.device("cuda", torch.cuda.current_device())
    return CudaBackend(device, pool)


def _tell_auto_on_cpu() -> None:
    """Warn once per process: a CPU user who left ``backend="auto"`` expects speed, and the emulated
    backend is a verification tool (CI, the hazard suite) that runs slower than eager."""
    global _told_auto_on_cpu
    if _told_auto_on_cpu:
        return
    _told_auto_on_cpu = True
    warnings.warn(AUTO_ON_CPU, ReplayWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside replaykit and the frameworks that call it
    (Lightning's hooks call ``ReplayCallback``), so the warning names the user's line."""
    frame, level = sys._getframe(2), 2  # 1: _tell_auto_on_cpu's caller, resolve_backend
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _CALLERS:
        frame, level = frame.f_back, level + 1
    return level


__all__ = [
    "AUTO_ON_CPU",
    "BACKENDS",
    "Backend",
    "Recording",
    "Region",
    "Scratch",
    "Subject",
    "capture_failure",
    "known_cause",
    "module_device",
    "refused_host_copy",
    "resolve_backend",
]
