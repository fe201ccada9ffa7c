"""Weights a region the caller opened computes once and caches: autocast's casts and
``parametrize.cached()``'s parametrized tensors.

Eager runs each step in its own region (``with torch.autocast(...): loss = step(x, y)``), so every
step computes them afresh from its weights. A recording call runs the step's code more than once
inside that one region: a run after the first finds the first run's tensors in the cache, and a
recording holds them as constants, so every replay would read the recording call's weights.
:func:`drop` empties both caches between runs (the call state does); :func:`uncached` keeps them
off while a recording captures several runs in a row (warm-up, capture) or the verification
reruns eager's forward on stand-ins.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.utils import parametrize

#: torch before 2.5 frees a cached cast when its region ends even while Python still holds it (a
#: recording made in the caller's region then held freed memory: "Cannot access data pointer")
FREES_HELD_CASTS = torch.torch_version.TorchVersion(torch.__version__) < (2, 5)


def region_reason(device: str) -> str | None:
    """Why a whole step inside the caller's autocast region (its cache on) runs eagerly on this
    torch, or None (every torch from 2.5)."""
    if FREES_HELD_CASTS and torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled():
        return (
            "autocast_region: called inside torch.autocast with its cache on, which torch "
            f"{torch.__version__} frees under a recording; pass precision= instead"
        )
    return None


def drop() -> None:
    """Empty both caches (cheap when empty: a recording call's, never a replay's, cost)."""
    if torch.is_autocast_cache_enabled():
        torch.clear_autocast_cache()
    if getattr(parametrize, "_cache_enabled", 0):
        parametrize._cache.clear()


@contextmanager
def uncached() -> Iterator[None]:
    """``parametrize.cached()`` off inside (autocast's cache is switched off by the recordings
    themselves, ``cache_enabled=False``); both caches emptied on the way in and out, so nothing
    computed from stand-ins stays behind for the caller's region."""
    depth = getattr(parametrize, "_cache_enabled", 0)
    drop()
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = depth
        drop()
