"""Backends behind one small interface: ``cuda`` (CUDA graphs) and ``emulated`` (any device)."""

from __future__ import annotations

import torch

from ..errors import ReplayError
from ..memory.pool import MemoryPool
from .base import Backend, Recording, Region
from .emulated import EmulatedBackend
from .scratch import Scratch

BACKENDS: tuple[str, ...] = ("auto", "cuda", "emulated")


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the module's first parameter or buffer (None for a stateless module)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def resolve_backend(name: str, module: torch.nn.Module, pool: MemoryPool | None = None) -> Backend:
    """``auto`` is ``cuda`` for a module on a CUDA device and ``emulated`` otherwise; ``pool``: a shared
    :class:`~replaykit.memory.pool.MemoryPool` (None: a private pool of its own)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ReplayError(f"unknown backend {name!r}; choose from {list(BACKENDS)}")
    device = module_device(module)
    if name == "auto":
        name = "cuda" if device is not None and device.type == "cuda" else "emulated"
    if name == "emulated":
        return EmulatedBackend(pool)
    from .cuda import CudaBackend

    if device is None:
        if not torch.cuda.is_available():
            raise ReplayError("backend='cuda' needs a CUDA GPU, and torch sees none")
        device = torch.device("cuda", torch.cuda.current_device())
    return CudaBackend(device, pool)


__all__ = [
    "BACKENDS",
    "Backend",
    "Recording",
    "Region",
    "Scratch",
    "module_device",
    "resolve_backend",
]
