"""Deterministic kernels: bitwise parity with eager presupposes that eager repeats itself.

On CUDA, cuDNN's and cuBLAS's fastest algorithms may accumulate in a run-dependent
order (atomics, split-K), so two eager runs already differ in their last bits. Parity
runs (tests, benchmarks, notebooks) switch to deterministic algorithms first.

A ``torch.compile``'d model's twin repeats itself only if inductor does too: its autotuning
picks kernels (and split reductions) by timing them, so two compilations of the same model may
pick differently. ``enable_determinism`` sets inductor's ``deterministic`` mode (no on-device
benchmarking where it changes numerics; ``TORCHINDUCTOR_DETERMINISTIC=1`` if inductor is not loaded
yet) and, if inductor is loaded, ``fallback_random`` (random ops draw as eager does) with
max-autotune off. What it cannot make deterministic: a compiled program
chosen before it was called (compile after calling it), and kernels inductor itself documents
as nondeterministic under ``torch.use_deterministic_algorithms`` (it then warns, as eager does).
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
        inductor.deterministic = True
        inductor.fallback_random = True
        inductor.max_autotune = False
        inductor.max_autotune_pointwise = False
        inductor.max_autotune_gemm = False
