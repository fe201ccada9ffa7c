"""One memory pool shared by several entry points' recordings, made safe to share.

An entry point's recordings share its private pool, so memory one capture freed serves the
next; ``pool=rk.MemoryPool()`` lets several entry points share one the same way. PyTorch's
caveat: a later graph may put live outputs in an earlier one's scratch. Within one entry point
copy-out and the hold keep that safe; across them, before one records or replays, every other
user must hold nothing live there (:meth:`claim`), or the call runs eagerly (``pool_busy``).
A lone user pays one comparison per call.

On the emulated backend a claim fills the other users' static outputs and gradients with NaN
(what a CUDA replay may do), so a holder without the protection sees it on a CPU.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch

from ..errors import ReplayError


class PoolUser(Protocol):
    """What an entry point sharing a pool provides (``Recorder`` and ``TrainStep``)."""

    def quiesce(self, call: int) -> bool:
        """Copy out what it handed out; False if something of its static memory must stay live.
        ``call``: the claiming entry point's call (its own journal keeps its own numbering)."""
        ...

    def static_tensors(self) -> list[torch.Tensor]:
        """The static outputs and gradients its recordings hold (what another graph may overwrite)."""
        ...


class MemoryPool:
    """A memory pool several entry points record into: ``rk.TrainStep(..., pool=p)``, ``rk.capture(..., pool=p)``."""

    def __init__(self) -> None:
        self._handles: dict[torch.device, tuple[int, int]] = {}
        self._anchors: dict[torch.device, object] = {}  # open_pool's graph per handle
        self._spent: dict[torch.device, list[tuple[int, int]]] = {}
        self._users: list[weakref.ref] = []
        self._holder: weakref.ref | None = None
        self.emulated = False  # set when an emulated backend joins: claims then overwrite

    def __repr__(self) -> str:
        return f"<MemoryPool users={len(self.users())} devices={sorted(map(str, self._handles))}>"

    def handle(self, device: torch.device) -> tuple[int, int]:
        """The CUDA graph pool of ``device`` (one per device, made at first use)."""
        if device not in self._handles:
            self._handles[device], self._anchors[device] = open_pool(device)
        return self._handles[device]

    def renew(self, device: torch.device, handle: tuple[int, int]) -> None:
        """A failed capture left ``handle`` unusable for captures (the CUDA backend says when):
        every user's later captures on ``device`` go to a new pool."""
        if self._handles.get(device) == handle:
            self._spent.setdefault(device, []).append(handle)
            self._handles[device], self._anchors[device] = open_pool(device)

    def join(self, user: PoolUser) -> None:
        """``user`` records into this pool from now on."""
        self._users = [r for r in self._users if r() is not None]
        if all(r() is not user for r in self._users):
            self._users.append(weakref.ref(user))

    def leave(self, user: PoolUser) -> None:
        """``user`` released its recordings: it holds nothing here any more."""
        self._users = [r for r in self._users if r() is not None and r() is not user]
        if self._holder is not None and self._holder() is user:
            self._holder = None

    def users(self) -> list[PoolUser]:
        return [u for r in self._users if (u := r()) is not None]

    def sole(self, user: PoolUser) -> bool:
        """Whether ``user`` is the only one recording here (no other's graphs may reuse its blocks)."""
        return all(u is user for u in self.users())

    def claim(self, user: PoolUser, call: int, safe: bool = True) -> bool:
        """Before ``user`` records or replays: True when it may (the others hold nothing live here).
        ``safe=False`` (``unsafe_disable=["shared_pool"]``) skips the others' check."""
        holder = self._holder() if self._holder is not None else None
        if holder is user:
            return True
        others = [u for u in self.users() if u is not user]
        if safe and not all([u.quiesce(call) for u in others]):
            return False
        if self.emulated:
            with torch.no_grad():
                for u in others:
                    for t in u.static_tensors():
                        if t.is_floating_point() or t.is_complex():
                            t.data.fill_(float("nan"))
        self._holder = weakref.ref(user)
        return True

    def reserved_bytes(self, device: torch.device) -> int | None:
        """Bytes the CUDA caching allocator holds in this pool on ``device`` (None: no pool there)."""
        handle = self._handles.get(device)
        if handle is None:
            return None
        return sum(pool_reserved(device, h) for h in (handle, *self._spent.get(device, ())))


def open_pool(device: torch.device) -> tuple[tuple[int, int], torch.cuda.CUDAGraph]:
    """A new CUDA graph pool's handle, and an empty graph captured into it that keeps it open. A
    pool whose last graph is reset while a block is live lingers at count zero, and the next capture
    into it fails ("use_count > 0 INTERNAL ASSERT" on the H200); the anchor graph holds one count
    while its owner keeps the handle."""
    with torch.cuda.device(device):
        handle = torch.cuda.graph_pool_handle()
        anchor = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty"
            with torch.cuda.graph(anchor, pool=handle):
                pass
    return handle, anchor


def pool_reserved(device: torch.device, handle: tuple[int, int]) -> int:
    """Bytes of the segments the caching allocator gave a graph pool (a full memory snapshot: a report, not the hot path)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") == index and tuple(segment.get("segment_pool_id", ())) == tuple(
            handle
        ):
            total += int(segment.get("total_size", 0))
    return total


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an alias counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def check_pool(pool: object) -> MemoryPool | None:
    """``pool=`` validated: None or a :class:`MemoryPool`."""
    if pool is not None and not isinstance(pool, MemoryPool):
        raise ReplayError(f"pool= takes an rk.MemoryPool or None, not {type(pool).__name__}")
    return pool
