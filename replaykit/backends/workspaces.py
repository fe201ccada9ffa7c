"""cuBLAS workspaces: each capture makes its own, as scratch of its pool.

cuBLAS keeps a workspace per (handle, stream), allocated at the first matmul on a stream and
held by torch for the life of the process (on the H200 two of 32 MiB: cuBLAS's and cuBLASLt's).
Left alone, a warm-up's side stream and the capture stream each keep one for good beside
eager's on the default stream, and a recorder's warm-up stream per recording adds another: on
the H200, 130 of a 246 MiB peak with eight shape buckets of a small LM.

So, as torch.compile's CUDA graph trees do, the workspaces are cleared before a capture, which
then allocates a fresh one in its own pool, and after it, which frees that one into the pool as
the graph's scratch: later captures reuse it as they reuse every temporary (under the same
copy-out and hold rules), and no graph writes memory that torch's map, rather than its pool,
owns. After a warm-up they are cleared too, so ``Backend.trim`` gives the side stream's back. A
stream's next eager matmul makes a new one.
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
