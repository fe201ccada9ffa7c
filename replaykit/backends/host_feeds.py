"""Host data a CUDA capture copies to the GPU: copied again before each replay, as eager's call does.

A step that moves a CPU tensor to the GPU (a collate function's mask in ``loss_fn``, a CPU batch,
``torch.tensor(numpy_schedule, device=...)``) makes a host-to-device copy, which a CUDA capture
refuses from pageable memory: the capture fails and the step retires, exact but never replayed.
The copy's source is host memory that outlives the call: the step's static CPU input (refilled
each call), a tensor the model holds (changed in place), or one made from host values that the
recording's key covers (a numpy array's bytes, a setting). :class:`HostFeeds`, a dispatch mode
around a capture, gives each such copy a device buffer of its own and leaves the copy out of the
graph; :meth:`HostFeeds.feed`, before each replay and in stream order, copies the source into it.

The buffers are made before the capture, from what an eager run of the same code copied
(:class:`FeedSpecs`, around a warm-up or the reference run): a buffer made inside the capture
comes from its pool, where a block may have held a temporary the graph writes before it reads the
buffer (seen on the H200: a second fed table read the first one's values), and a block from
anywhere else would need a ``cudaMalloc`` the capture forbids. A copy that matches no buffer is
left as it is (the capture fails, as before): so is every copy of a step recorded without the
verification (``unsafe_disable=("verify_recording",)``), which runs no reference to learn from.

``torch.tensor(0.0, device="cuda")`` copies Python data inside C++, out of a dispatch mode's sight: while
either mode is on, such a call makes its tensor on the host and moves it (:class:`_FromHost`), a
copy the mode sees (transformers' eager attention mask makes one at every call).

A source computed on the host during the run (``mask.float()``, a sort of lengths) ran once and
would be frozen: its copy is never fed. Pinned sources are left to the graph, which copies them
at each replay by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..verify.dispatch import WatchingMode, written

__all__ = ["FeedSpecs", "HostFeeds", "Spec", "refused_host_copy"]

_TO_COPY = torch.ops.aten._to_copy.default
_COPY_ = torch.ops.aten.copy_.default
#: Ops whose output is the host data they were given, not computed from it (``torch.tensor``'s).
_FRESH = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})

#: A fed copy's source layout: sizes, strides, dtype.
Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def refused_host_copy(exc: BaseException) -> bool:
    """Whether a capture failed on a host-to-device copy from pageable memory (torch's message)."""
    return "unless the CPU tensor is pinned" in str(exc)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _spec(t: torch.Tensor) -> Spec:
    return (tuple(t.shape), t.stride(), t.dtype)


_FACTORIES = frozenset({torch.tensor, torch.as_tensor})


def _python_data(args: tuple) -> bool:
    """Python numbers or lists (a tensor's or a numpy array's copy is seen already: it is
    dispatched from the array's own memory, which a rewrite would copy first and freeze)."""
    return bool(args) and isinstance(args[0], (int, float, bool, complex, list, tuple))


class _FromHost(TorchFunctionMode):
    """``torch.tensor(0.0, device=cuda)`` as ``torch.tensor(0.0).to(device)``: the same values, and
    a copy the dispatch mode sees (the factory's own copy of Python data runs where no mode does)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func in _FACTORIES
            and _python_data(args)
            and _to_device(kwargs.get("device"))
            and not kwargs.get("requires_grad")
        ):
            here = {k: v for k, v in kwargs.items() if k != "device"}
            return func(*args, **here).to(kwargs["device"])
        return func(*args, **kwargs)


class _HostCopies(WatchingMode):
    """Finds each host-to-device copy whose source outlives the call, and hands it to :meth:`_copy`."""

    def __init__(self) -> None:
        super().__init__()
        self._computed: set[int] = set()  # storages of CPU tensors computed during the run
        self._from_host = _FromHost()

    def __enter__(self) -> _HostCopies:
        self._from_host.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._from_host.__exit__(*exc)

    def _copy(self, func: Any, args: tuple, kwargs: dict, source: torch.Tensor) -> Any:
        """The copy's result, or None to run it as it is."""
        raise NotImplementedError

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        source = None
        if func is _TO_COPY and _to_device(kwargs.get("device")):
            source = args[0]
        elif func is _COPY_ and args[0].device.type == "cuda":
            source = args[1]
        if source is not None and self._outlives(source):
            out = self._copy(func, args, kwargs, source)
            if out is not None:
                return out
        out = self.run(func, args, kwargs)
        if func not in _FRESH:
            self._note(func, args, kwargs, out)
        return out

    def _outlives(self, source: Any) -> bool:
        return (
            isinstance(source, torch.Tensor)
            and source.device.type == "cpu"
            and source.layout == torch.strided
            and not source.is_pinned()
            and _storage(source) not in self._computed
        )

    def _note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Mark the CPU tensors this op computed (not views of its arguments) or wrote in place."""
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if given or torch.Tag.nondeterministic_seeded in func.tags:
            views = {_storage(t) for t in given}
            for t in tree_leaves(out):
                cpu = isinstance(t, torch.Tensor) and t.device.type == "cpu"
                if cpu and _storage(t) not in views:
                    self._computed.add(_storage(t))
        for t in written(func, args, kwargs):
            if t.device.type == "cpu":
                self._computed.add(_storage(t))


class FeedSpecs(_HostCopies):
    """Around an eager run: the layouts of the copies a capture of the same code would feed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[Spec] = []

    def _copy(self, func: Any, args: tuple, kwargs: dict, source: torch.Tensor) -> Any:
        self.specs.append(_spec(source))
        return None


class HostFeeds(_HostCopies):
    """Around one capture: the copies :class:`FeedSpecs` found, in order, read buffers made here
    (before the capture) that :meth:`feed` fills before each replay."""

    def __init__(self, device: torch.device, specs: Sequence[Spec]) -> None:
        super().__init__()
        self._specs = list(specs)
        self._buffers = [
            torch.empty_strided(size, stride, dtype=dtype, device=device)
            for size, stride, dtype in self._specs
        ]
        self.feeds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device buffer, host source)

    def feed(self) -> None:
        """Copy each source into its buffer, in stream order before the graph that reads it (from
        pageable memory the copy is staged at once: the source may change after this returns)."""
        for buffer, source in self.feeds:
            buffer.copy_(source, non_blocking=True)

    def _copy(self, func: Any, args: tuple, kwargs: dict, source: torch.Tensor) -> Any:
        i = len(self.feeds)
        if i >= len(self._specs) or _spec(source) != self._specs[i]:
            return None  # not what the eager run copied: the capture fails on it
        buffer = self._buffers[i]
        self.feeds.append((buffer, source))
        if func is _TO_COPY:
            return func(buffer, *args[1:], **kwargs)
        return func(args[0], buffer, *args[2:], **kwargs)


def _to_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"
