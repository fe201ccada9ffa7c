"""Deterministic kernels: bitwise parity with eager presupposes that eager repeats itself.

cuDNN's and cuBLAS's fastest algorithms may accumulate in a run-dependent order, and inductor's
autotuning picks kernels by timing them. ``enable_determinism`` sets deterministic algorithms,
inductor's ``deterministic`` mode (``TORCHINDUCTOR_DETERMINISTIC=1`` if not loaded yet) and, if
loaded, ``fallback_random`` with max-autotune off. It cannot fix a program compiled before it was
called, nor kernels inductor documents as nondeterministic (it warns, as eager does).
"""

from __future__ import annotations

import os
import sys

import torch


def enable_determinism() -> None:
    """Deterministic algorithms everywhere; call before the first cuBLAS use and before compiling."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # inductor reads its switch when it is imported (about 2.5 s: not here); if it is loaded, set it now
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        if hasattr(inductor, "deterministic"):  # torch 2.4's inductor has no such mode
            inductor.deterministic = True
        inductor.fallback_random = True
        inductor.max_autotune = False
        inductor.max_autotune_pointwise = False
        inductor.max_autotune_gemm = False
