"""Host work inside a recorded whole step: the gap between two graphs (the "two-graph form").

A collective a graph cannot hold (a gloo all-reduce copies through the host; DDP's buffer
broadcast and reducer run Python) must run between recorded segments of a step. The body calls
:func:`gap` with that work where it belongs: outside a capture (the eager twin, the reference
run) the work just runs; inside one, the region keeps it in the body's order and runs it at
every replay — the emulated tape as one more entry of its sequence, a CUDA region between two
graphs (it ends the graph captured so far and begins the next in the same pool).

The work is bound (``bind``) at capture to the tensors it acts on (the static buffers the segments write
and read). It runs during an emulated capture (which executes) and not during a CUDA capture
(which executes nothing: the replay right after it is the call's step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["capturing", "gap", "open_gaps"]

_active = threading.local()


def capturing() -> bool:
    """Whether a region is capturing a body on this thread (a body with gaps takes its split form)."""
    return getattr(_active, "region", None) is not None


def gap(bind: Callable[[], Callable[[], None]], first: bool = False) -> None:
    """Host work at this point of the body: ``bind()`` makes it (allocating its buffers outside
    what a capture records); kept by the capturing region, else run now. ``first``: nothing was
    recorded before it in this capture (a CUDA region then needs no graph before it)."""
    region = getattr(_active, "region", None)
    if region is None:
        bind()()
    else:
        region.gap(bind, first)


@contextmanager
def open_gaps(region: Any) -> Iterator[None]:
    """While ``region`` captures a body: where :func:`gap` sends the body's host work."""
    _active.region = region
    try:
        yield
    finally:
        _active.region = None
