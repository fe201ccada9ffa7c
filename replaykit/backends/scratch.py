"""Eager work in a recording pool's free memory: the recording call's reference step.

Run beside the pool, the reference step's temporaries need memory the pool already holds free
between replays (8 shape buckets peaked at 1.92x eager's reserved memory on the H200). So, as
torch.compile's CUDA graph trees do for warm-ups, it runs on the capture stream with its
allocations routed into the pool (:class:`PoolScratch`).

What it leaves there (eager's loss or gradients when that run stands, a module's cache) may
sit in an earlier recording's scratch, which that recording's next replay overwrites (a later
recording's capture sees the block live). So the entry point asks :meth:`Scratch.survivors`
and frees the earlier recordings when anything is left (``pool_survivors``); :meth:`Scratch.owns`
lets it copy out the results it hands back first. On the emulated backend
:class:`TrackedScratch` tracks the tensors made inside and an earlier region's replay
overwrites survivors with NaN (:class:`Exposure`), so a CPU run shows the hazard.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from . import workspaces


class Scratch:
    """Runs eager work beside the pool (the base: nothing routed, nothing left)."""

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def survivors(self) -> int:
        """Bytes allocated inside and still live (an earlier recording's replay may overwrite them)."""
        return 0

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory was allocated inside and is still live."""
        return False


def _live_blocks(device: torch.device, pool: tuple[int, int]) -> dict[int, int]:
    """Address -> size of the live blocks of a graph pool (a memory snapshot: recording calls only)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    live: dict[int, int] = {}
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != index or tuple(segment.get("segment_pool_id", ())) != tuple(
            pool
        ):
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated":
                live[int(block["address"])] = int(block["size"])
    return live


def pool_routing() -> bool:
    """Whether this torch can route a stream's allocations to a graph pool (torch >= 2.6)."""
    return all(
        hasattr(torch._C, name)
        for name in (
            "_cuda_beginAllocateCurrentStreamToPool",
            "_cuda_endAllocateToPool",
            "_cuda_releasePool",
        )
    )


class PoolScratch(Scratch):
    """CUDA: the work runs on ``stream`` (where the pool's captures ran: its free blocks belong to
    that stream) with that stream's allocations, the backward's on autograd's threads included,
    going to ``pool``; cuBLAS workspaces made inside are freed there too."""

    def __init__(self, device: torch.device, pool: tuple[int, int], stream: Any) -> None:
        self.device, self.pool, self.stream = device, pool, stream
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._before: dict[int, int] = {}
        self._ctx: Any = None
        self._owned: dict[int, int] | None = None  # _left() as `owns` first saw it

    def __enter__(self) -> PoolScratch:
        torch.cuda.synchronize(self.device)
        self._before = _live_blocks(self.device, self.pool)
        workspaces.clear()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        torch._C._cuda_beginAllocateCurrentStreamToPool(self._index, self.pool)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            workspaces.clear()  # the stream's workspace was allocated inside: freed into the pool
        finally:
            torch._C._cuda_endAllocateToPool(self._index, self.pool)
            torch._C._cuda_releasePool(self._index, self.pool)
            self._ctx.__exit__(*exc)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _left(self) -> dict[int, int]:
        torch.cuda.synchronize(self.device)
        now = _live_blocks(self.device, self.pool)
        return {a: s for a, s in now.items() if self._before.get(a) != s}

    def survivors(self) -> int:
        return sum(self._left().values())

    def owns(self, t: torch.Tensor) -> bool:
        if self._owned is None:
            self._owned = self._left()
        ptr = t.untyped_storage().data_ptr()
        return any(a <= ptr < a + s for a, s in self._owned.items())


class Exposure:
    """The emulated backend's record of survivors: an earlier region's replay overwrites them."""

    def __init__(self) -> None:
        self.epoch = 0
        self._left: list[tuple[int, weakref.ref]] = []

    def add(self, tensors: list[torch.Tensor]) -> None:
        self.epoch += 1
        self._left = [(e, r) for e, r in self._left if r() is not None]
        self._left += [(self.epoch, weakref.ref(t)) for t in tensors]

    def overwrite(self, since: int) -> None:
        """A region made at ``since`` replays: survivors of later scratch runs get NaN, as a graph
        replay writing its scratch over them would leave them."""
        if not self._left:
            return
        for epoch, ref in self._left:
            t = ref()
            if epoch > since and t is not None and (t.is_floating_point() or t.is_complex()):
                # an inference tensor (a cache made under inference_mode) is written only there
                with torch.inference_mode() if t.is_inference() else torch.no_grad():
                    t.data.fill_(math.nan)


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def _dense(t: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
    """The plain tensors holding ``t``'s memory, each with its storage's address and size: ``t``,
    or a wrapper subclass's inner tensors (a nested jagged tensor's values and offsets); none for
    a tensor without a storage (sparse, a functorch wrapper)."""
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [d for n in names for d in _dense(getattr(t, n))]
    try:
        storage = t.untyped_storage()
        return [(t, storage.data_ptr(), storage.nbytes())]
    except (RuntimeError, NotImplementedError):
        return []


class _Made(TorchDispatchMode):
    """Collects the tensors whose storage an op made (not an input's: in-place ops and views of
    inputs are not new), and the aliases of those storages: a view or ``detach`` of a new tensor
    can outlive the tensor itself (an inference-mode view holds no base), and the storage with it.
    ``torch.tensor(data)`` is made outside dispatch and shows here as ``lift_fresh``."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []
        self._ptrs: set[int] = set()  # storages made inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        old = {ptr for x in leaves for _, ptr, _ in _dense(x)}
        fresh = func is _LIFT_FRESH  # its input is the new tensor
        for x in tree_leaves(out):
            if not isinstance(x, torch.Tensor) or (not fresh and any(x is i for i in leaves)):
                continue  # an in-place op's result is its input
            for t, ptr, _ in _dense(x):
                if fresh or ptr not in old or ptr in self._ptrs:
                    self._ptrs.add(ptr)
                    self.made.append(weakref.ref(t))
        return out


class TrackedScratch(Scratch):
    """Emulated: tracks the tensors made inside; at exit, the live ones are exposed to earlier regions."""

    def __init__(self, exposure: Exposure) -> None:
        self._exposure = exposure
        self._mode = _Made()

    def __enter__(self) -> TrackedScratch:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self._exposure.add(self._live())  # what is still live at the end: a later death is skipped

    def _live(self) -> list[torch.Tensor]:
        return [t for r in self._mode.made if (t := r()) is not None and _dense(t)[0][2]]

    def survivors(self) -> int:
        seen = {ptr: size for t in self._live() for _, ptr, size in _dense(t)}
        return sum(seen.values())

    def owns(self, t: torch.Tensor) -> bool:
        live = {ptr for m in self._live() for _, ptr, _ in _dense(m)}
        return any(ptr in live for _, ptr, _ in _dense(t))
