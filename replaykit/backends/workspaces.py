"""cuBLAS workspaces: each capture makes its own, as scratch of its pool.

cuBLAS keeps a workspace per (handle, stream) for the life of the process: left alone, the
warm-up and capture streams each kept one for good (130 of a 246 MiB peak on the H200 with eight
shape buckets). So, as torch.compile's CUDA graph trees do, the workspaces are cleared before a
capture (which allocates a fresh one in its pool) and after it (which frees it into the pool as
scratch), and after a warm-up, so ``Backend.trim`` gives the side stream's back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def clear() -> None:
    """Drop torch's cuBLAS and cuBLASLt workspaces (every stream's); the next matmul makes anew."""
    clear_all = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_all is not None:
        clear_all()


@contextlib.contextmanager
def own_workspaces() -> Iterator[None]:
    """Around a capture: its matmuls use a workspace allocated inside it, freed into its pool at its end."""
    clear()
    try:
        yield
    finally:
        clear()
