"""The CUDA backend: ``torch.cuda.CUDAGraph`` recordings sharing one private memory pool.

Recording follows ``make_graphed_callables``: warm-up on a side stream, then a forward graph.
The backward graph is captured at the first backward, in the layout its gradients arrive in: a
reduction over another layout sums in another order (last-bit differences on the H200 for
channels-last); a later backward with other outputs or layouts runs exactly through the recorded
autograd graph. Autocast's cast cache is off while capturing (a cached cast would outlive it);
``torch.cuda.graph`` registers the default generator, so dropout advances Philox as eager does.

The module runs on detached stand-ins of its parameters: their own AccumulateGrad nodes, made
on the side stream, would make every later backward wait across streams (replay fell to eager
speed on the H200). Saved-tensor hooks (``_Saved``) keep the captured autograd graph usable
after in-place optimizer updates (no version check) and after the backward capture freed them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ReplayError
from ..guards.signature import autocast_key
from ..memory.layout import compact, compact_size
from ..memory.pool import MemoryPool, open_pool, pool_reserved
from . import workspaces
from .base import (
    Backend,
    Recording,
    Region,
    Subject,
    differentiable_indices,
)
from .collector import collector_paused
from .gaps import open_gaps
from .host_feeds import FeedSpecs, HostFeeds, Spec
from .scratch import PoolScratch, Scratch, pool_routing
from .seeding import SeedingRefused


class _Saved:
    """A tensor the captured forward saved for backward. Let go once the full backward read it, so
    its temporaries reuse the memory (retaining it cost ~15% on the H200); afterwards rebuilt from
    its address, which every forward replay rewrites before a partial backward reads it (the hold
    keeps other replays out)."""

    __slots__ = ("meta", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = t.detach()
        s = t.untyped_storage()
        self.meta = (
            s.data_ptr(),
            s.nbytes(),
            t.device,
            t.dtype,
            t.size(),
            t.stride(),
            t.storage_offset(),
        )

    def get(self, release: bool) -> torch.Tensor:
        t = self.tensor
        if t is not None:
            if release:
                self.tensor = None
            return t
        ptr, nbytes, device, dtype, size, stride, offset = self.meta
        storage = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


class _SavedHooks:
    """Saved-tensor hooks: no version check, and release of ownership during the backward capture."""

    def __init__(self) -> None:
        self.release = False
        self.saved: list[_Saved] = []

    def pack(self, t: torch.Tensor) -> _Saved:
        saved = _Saved(t)
        self.saved.append(saved)
        return saved

    def disown(self, tensors: Sequence[torch.Tensor]) -> None:
        """Saved tensors on these tensors' storage are owned by them already: hold no second
        reference. Copy-out counts a static output's references; one that disappeared later, when
        the backward capture lets saved tensors go, would read as a change."""
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        for saved in self.saved:
            if saved.tensor is not None and saved.meta[0] in storages:
                saved.tensor = None
        self.saved = []

    def unpack(self, saved: _Saved) -> torch.Tensor:
        return saved.get(self.release)


class CudaRecording(Recording):
    """A forward graph, a full-backward graph, and the autograd graph they came from."""

    def __init__(
        self,
        subject: Subject,
        pool: tuple[int, int],
        device: torch.device,
        spent: Callable[[tuple[int, int]], None] = lambda pool: None,
    ) -> None:
        self._spent = spent  # told when a failed capture leaves the pool's id unusable
        self._generators = subject.generators
        leaves = self._stand_ins(subject)
        enabled, dtype = autocast_key("cuda")

        def forward() -> list[torch.Tensor]:
            with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
                return self._outputs(subject, leaves)

        def backward(outs: list[torch.Tensor], grads: Sequence[torch.Tensor], retain: bool):
            if not self.differentiable or not self._targets:
                return [None] * len(self._targets)
            with torch.autocast("cuda", enabled=False):
                return torch.autograd.grad(
                    [outs[i] for i in self.differentiable],
                    self._targets,
                    list(grads),
                    retain_graph=retain,
                    allow_unused=True,
                )

        specs: list[Spec] = []

        def learning() -> list[torch.Tensor]:  # the host copies a capture would feed
            found = FeedSpecs()
            with found:
                outs = forward()
            specs[:] = found.specs
            return outs

        self._warm_up(learning if subject.host_feeds else forward, backward, subject.warmup, device)
        self._feeds = HostFeeds(device, specs) if subject.host_feeds else None
        outs = self._capture_forward(forward, pool, device, spent)
        self.differentiable = differentiable_indices(outs)
        self.static_outputs = outs
        self._hooks.disown(outs)
        self.static_grads = [None] * len(self._targets)
        self._pool, self._device = pool, device
        self._bwd: torch.cuda.CUDAGraph | None = None
        self._bwd_layout: tuple | None = None
        self._grad_bases: list[torch.Tensor] = []  # one per gradient the captured backward reads
        self._broadcast: list[bool] = []
        self.capture_error: str | None = None

    def _warm_up(
        self,
        forward: Callable[[], list[torch.Tensor]],
        backward: Callable[..., Sequence[torch.Tensor | None]],
        warmup: int,
        device: torch.device,
    ) -> None:
        """Eager warm-up runs on a side stream, each a forward and a backward, as before a capture."""
        current = torch.cuda.current_stream(device)
        # eager's workspaces and cached blocks go first, so the warm-up's never add to them
        torch.cuda.synchronize(device)
        workspaces.clear()
        torch.cuda.empty_cache()
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                outs = forward()
                self.differentiable = differentiable_indices(outs)
                backward(
                    outs, [torch.zeros_like(outs[i]) for i in self.differentiable], retain=False
                )
                del outs
        current.wait_stream(side)
        torch.cuda.synchronize(device)
        # the side stream's cached blocks (its cuBLAS workspace too) serve no later allocation on
        # another stream: give them back before the capture grows the pool, so the two never add up
        workspaces.clear()
        torch.cuda.empty_cache()

    def _capture_forward(
        self,
        forward: Callable[[], list[torch.Tensor]],
        pool: tuple[int, int],
        device: torch.device,
        spent: Callable[[tuple[int, int]], None],
    ) -> list[torch.Tensor]:
        """The forward graph's capture, its saved tensors under our hooks; a failed capture ends cleanly."""
        self._fwd = register(torch.cuda.CUDAGraph(), self._generators)
        self._hooks = _SavedHooks()
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(self._hooks.pack, self._hooks.unpack),
                workspaces.own_workspaces(),
                collector_paused(),
                torch.cuda.graph(self._fwd, pool=pool),
                self._feeds if self._feeds is not None else contextlib.nullcontext(),
                SeedingRefused(),
            ):
                return forward()
        except BaseException:
            if end_failed_capture(device, pool, self._generators):
                spent(pool)
            raise

    def replay_forward(self) -> None:
        if self._feeds is not None:
            self._feeds.feed()
        self._fwd.replay()
        self.generation += 1

    def backward(
        self, grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], str | None]:
        if self._bwd is not None and _layout(grads) == self._bwd_layout:
            srcs = [
                g if not broadcast else compact(g)
                for g, broadcast in zip(grads, self._broadcast, strict=True)
                if g is not None
            ]
            # one launch (same dtype) where mgc copies per output
            torch._foreach_copy_(self._grad_bases, srcs)
            self._bwd.replay()
            handed = self.handed_grads or self.static_grads
            return [None if g is None else g.detach() for g in handed], None
        how = "partial" if any(g is None for g in grads) else "layout"
        if self._bwd is None:
            how = f"capture failed: {self.capture_error}"
        return self.exact_backward(grads), how

    def prepare_backward(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """At the first backward: capture the backward graph for these gradients, in their layout.
        Runs on the autograd engine's thread (a reentrant backward over the recorded graph); each
        saved tensor is freed after its last read, as in ``make_graphed_callables``."""
        if self._bwd is not None or self.capture_error is not None:
            return False
        bases: list[torch.Tensor | None] = []
        views: list[torch.Tensor] = []
        for g in grads:
            if g is None:
                bases.append(None)
                continue
            base = torch.empty_strided(
                compact_size(g.size(), g.stride()), g.stride(), dtype=g.dtype, device=g.device
            )
            bases.append(base)
            # the incoming layout, broadcasts included
            views.append(base.as_strided(g.size(), g.stride()))
        read = [i for i, g in zip(self.differentiable, grads, strict=True) if g is not None]
        graph = register(torch.cuda.CUDAGraph(), self._generators)
        self._hooks.release = True
        try:
            with (
                torch.cuda.device(self._device),
                workspaces.own_workspaces(),
                collector_paused(),
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
                torch.autocast("cuda", enabled=False),
            ):
                static = torch.autograd.grad(
                    [self.static_outputs[i] for i in read],
                    self._targets,
                    views,
                    retain_graph=True,
                    allow_unused=True,
                )
        except Exception as exc:  # the eager path stays exact; the journal says why
            self.capture_error = f"{type(exc).__name__}: {exc}"
            if end_failed_capture(self._device, self._pool, self._generators):
                self._spent(self._pool)
            return False
        finally:
            self._hooks.release = False
        self._bwd, self._bwd_layout = graph, _layout(grads)
        self._grad_bases = [b for b in bases if b is not None]
        self._broadcast = [g is not None and 0 in g.stride() for g in grads]
        self.static_grads = list(static)
        return True

    def exact_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Eager through the recorded autograd graph: exactly what eager computes for these
        gradients. Its temporaries come from the ordinary allocator, not the pool, so the
        activations stay."""
        pairs = [(i, g) for i, g in zip(self.differentiable, grads, strict=True) if g is not None]
        if not pairs or not self._targets:
            return [None] * len(self._targets)
        return list(
            torch.autograd.grad(
                [self.static_outputs[i] for i, _ in pairs],
                self._targets,
                [g for _, g in pairs],
                retain_graph=True,
                allow_unused=True,
            )
        )

    def free(self) -> None:
        self._fwd.reset()
        if self._bwd is not None:
            self._bwd.reset()
        self.static_outputs = []
        self.static_grads = []
        self._grad_bases = []
        self.static_inputs = []
        self._targets = []  # stand-ins alias the parameters' memory: a module moved off the GPU must not stay pinned
        self._hooks = _SavedHooks()
        self._feeds = None
        self.host_memory = None


def register(
    graph: torch.cuda.CUDAGraph, generators: Sequence[torch.Generator]
) -> torch.cuda.CUDAGraph:
    """``graph`` with the module's own generators registered (torch registers the default one): a
    replay reads each one's seed and offset then and advances it by what the capture drew, as
    eager's call does, so a private generator replays exactly."""
    if generators and not hasattr(graph, "register_generator_state"):
        raise ReplayError(
            "this torch's CUDAGraph cannot register a private torch.Generator "
            "(register_generator_state); draw from the default generator, or upgrade torch"
        )
    for g in generators:
        graph.register_generator_state(g)
    return graph


def end_failed_capture(
    device: torch.device, pool: tuple[int, int], generators: Sequence[torch.Generator] = ()
) -> bool:
    """Put the CUDA generators back after a capture that raised; True when ``pool`` is spent. A
    raising capture can leave the default generator (and ``generators``, registered with it) marked
    capturing (every later random op then
    fails: "Offset increment outside graph capture"); an empty capture clears it. A capture CUDA
    invalidated raises before the allocators stop routing into ``pool`` ("already recording to
    mempool_id" next time): the device allocator's routing is ended here; the pinned-host one has no
    handle, so the pool's id is spent."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
        spent = True  # it was still routing: capture_end raised before ending it
    except RuntimeError:  # "not currently recording": the capture ended cleanly
        spent = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        # an error of the failed capture: the reset below still runs
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize(device)
        graph = register(torch.cuda.CUDAGraph(), generators)
        with torch.cuda.device(device), torch.cuda.graph(graph):
            pass
        graph.reset()
    return spent


def _layout(grads: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(None if g is None else g.stride() for g in grads)


class CudaBackend(Backend):
    """CUDA graphs in one private memory pool shared by a recorder's recordings."""

    name = "cuda"

    def __init__(self, device: torch.device, pool: MemoryPool | None = None) -> None:
        if not torch.cuda.is_available():
            raise ReplayError("backend='cuda' needs a CUDA GPU, and torch sees none")
        if device.type != "cuda":
            raise ReplayError(f"backend='cuda' needs the module on a CUDA device, not {device}")
        self.device = device
        self._shared = pool
        self._own: tuple[int, int] | None = None  # opened at the first capture
        self._anchor: torch.cuda.CUDAGraph | None = None  # keeps _own open (open_pool)
        self._spent_pools: list[tuple[int, int]] = []

    @property
    def pool(self) -> tuple[int, int]:
        """The pool new captures go to (a shared ``MemoryPool``'s, read each time: it may renew)."""
        if self._shared is not None:
            return self._shared.handle(self.device)
        if self._own is None:
            self._own, self._anchor = open_pool(self.device)
        return self._own

    def spend(self, handle: tuple[int, int]) -> None:
        """A failed capture left ``handle`` unusable for captures: new ones take a new pool
        (recordings already in it keep their memory there)."""
        if self._shared is not None:
            self._shared.renew(self.device, handle)
        elif self._own == handle:
            self._spent_pools.append(handle)
            self._own, self._anchor = open_pool(self.device)

    def pool_reserved(self) -> int | None:
        if self._shared is not None:
            return self._shared.reserved_bytes(self.device)
        return sum(
            pool_reserved(self.device, h) for h in (self._own, *self._spent_pools) if h is not None
        )

    def record(self, subject: Subject) -> Recording:
        for t in subject.static_inputs:
            # host inputs the forward reads on the host (lengths) or copies over (fed: host_feeds)
            host = t.device.type == "cpu" and not t.requires_grad
            if t.device != self.device and not host:
                raise ReplayError(f"input on {t.device}, recorder on {self.device}")
        with torch.cuda.device(self.device):
            return CudaRecording(subject, self.pool, self.device, self.spend)

    def region(self, fixed: Sequence[torch.Tensor]) -> Region:
        return CudaRegion(self.device, self.pool, self.spend)

    def free(self) -> None:
        """Close the own pool (its recordings are freed): what is left of it goes when its last
        tensor does, and a later recording opens a new one. A shared ``MemoryPool`` stays open."""
        self._own, self._anchor = None, None
        self._spent_pools = []

    def trim(self) -> None:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            workspaces.clear()  # a warm-up stream's, eager's: the capture makes its own in the pool
            torch.cuda.empty_cache()


class CudaRegion(Region):
    """A ``torch.cuda.CUDAGraph`` in the backend's private pool (shared by its recordings). A
    capture executes nothing: the recording call's work is one replay right after it."""

    def __init__(
        self,
        device: torch.device,
        pool: tuple,
        spent: Callable[[tuple[int, int]], None] = lambda pool: None,
    ) -> None:
        self.device = device
        self.pool = pool
        self._spent = spent
        self.graph: torch.cuda.CUDAGraph | None = None
        # with gaps (two-graph form): each graph's replay and the host work between, in order
        self._parts: list[Callable[[], None]] = []
        self._capture: Any = None
        self._feeds: HostFeeds | None = None

    def capture(
        self, body: Callable[[], list[torch.Tensor]], host_feeds: Sequence[Spec] | None = None
    ) -> list[torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        self._parts = []
        self._capture = torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")
        self._feeds = None if host_feeds is None else HostFeeds(self.device, host_feeds)
        with (
            torch.cuda.device(self.device),
            workspaces.own_workspaces(),
            collector_paused(),
            self._capture,
            open_gaps(self),
            self._feeds if self._feeds is not None else contextlib.nullcontext(),
            SeedingRefused(),
        ):
            outs = body()
        self.graph = self._capture.cuda_graph  # the last segment's (a gap began a new one)
        self._capture = None
        if self._parts:
            self._parts.append(self.graph.replay)
        self.replay()  # a capture executes nothing: this is the recording call's step
        return outs

    def gap(self, bind: Callable[[], Callable[[], None]], first: bool) -> None:
        """Host work between two graphs (:mod:`.gaps`): end the graph captured so far (none when
        ``first``), keep the work, begin the next graph in the same pool and capture stream."""
        ctx = self._capture
        assert ctx is not None
        if not first:
            ctx.cuda_graph.capture_end()
            self._parts.append(ctx.cuda_graph.replay)
            ctx.cuda_graph = torch.cuda.CUDAGraph()
            ctx.cuda_graph.capture_begin(*ctx.pool, capture_error_mode=ctx.capture_error_mode)
        self._parts.append(bind())  # its buffers are the pool's, like the graphs' static memory

    def replay(self) -> None:
        assert self.graph is not None
        if self._feeds is not None:
            self._feeds.feed()
        if self._parts:
            for part in self._parts:
                part()
        else:
            self.graph.replay()

    def abort(self) -> None:
        if end_failed_capture(self.device, self.pool):
            self._spent(self.pool)

    def scratch(self) -> Scratch:
        stream = torch.cuda.graph.default_capture_stream  # where this pool's captures ran
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if stream is None or stream.device != torch.device("cuda", index) or not pool_routing():
            return Scratch()
        return PoolScratch(self.device, self.pool, stream)

    def free(self) -> None:
        self.graph = None
        self._parts = []
        self._feeds = None
