"""Python's garbage collector held off while a capture runs.

A collection can start at any Python allocation, inside a captured forward too, and it runs the
destructors and finalizers of whatever it frees: an earlier recording's hand-outs moving held
outputs (``memory/copy_out.py``), a CUDA graph and its pool going away. Inside a capture, their
device work is recorded into the graph or invalidates it ("operation failed due to a previous
error during capture"): on the H200 the full CUDA core suite failed a capture so, about 200 tests
in, while each pair of files passed alone and the whole run passed with the collector off.
``torch.cuda.graph`` collects once before it begins; this keeps further collections out until the
capture ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block (an explicit ``gc.collect()`` still runs)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
