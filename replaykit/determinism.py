"""Deterministic kernels: bitwise parity with eager presupposes that eager repeats itself.

On CUDA, cuDNN's and cuBLAS's fastest algorithms may accumulate in a run-dependent
order (atomics, split-K), so two eager runs already differ in their last bits. Parity
runs (tests, benchmarks, notebooks) switch to deterministic algorithms first.
"""

from __future__ import annotations

import os

import torch


def enable_determinism() -> None:
    """Deterministic algorithms everywhere; call before the first cuBLAS use for full effect."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
