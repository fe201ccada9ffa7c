"""Static buffers' memory layout: how a private copy of an input keeps what a kernel can see.

A kernel's reduction order can depend on an input's strides and address alignment, so a static
copy keeps the caller's sizes, strides and alignment (:func:`aligned_copy`, :func:`aligned_key`,
part of the signature), not its storage offset, so batches sliced from one preloaded tensor share
a recording; :func:`same_layout` (the offset too) makes eager stand-ins. A broadcast (stride-0) dimension holds one element: sizes here are *compact*
(:func:`compact_size`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ReplayError

#: Per device type, the bytes below which an address's alignment can choose a kernel's path:
#: what each allocator guarantees a fresh tensor (CUDA's caching allocator 512, c10's CPU
#: allocator 64), so fresh batches all share one class.
ALIGNMENT = {"cuda": 512, "cpu": 64}


def compact_size(size: Sequence[int], stride: Sequence[int]) -> list[int]:
    """The sizes with broadcast (stride 0) dimensions shrunk to 1: the memory a tensor really has."""
    return [1 if st == 0 else n for n, st in zip(size, stride, strict=True)]


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed at its compact size (see :func:`compact_size`)."""
    return t.as_strided(compact_size(t.shape, t.stride()), t.stride(), t.storage_offset())


def extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last real element, inclusive (0 for an empty tensor)."""
    if not t.numel():
        return 0
    return (
        sum(
            (n - 1) * st
            for n, st in zip(compact_size(t.shape, t.stride()), t.stride(), strict=True)
        )
        + 1
    )


def alignment(t: torch.Tensor) -> int:
    """Where ``t``'s address sits within its device's alignment (0 for a fresh tensor)."""
    return t.data_ptr() % ALIGNMENT.get(t.device.type, 512)


def aligned_key(t: torch.Tensor) -> tuple:
    """A tensor's signature key with its address's alignment instead of its storage offset."""
    return (t.shape, t.stride(), alignment(t), t.dtype, t.device, t.requires_grad)


def copy_into(static: torch.Tensor, x: torch.Tensor) -> None:
    """``static.copy_(x)`` without an autograd version bump; a broadcast layout copies its real elements."""
    # same strides as x (they are part of the signature) unless input_layout is off
    if 0 in static.stride():
        size = compact_size(static.shape, static.stride())
        static = static.as_strided(size, static.stride(), static.storage_offset())
        x = x.detach().as_strided(size, x.stride(), x.storage_offset())
    static.data.copy_(x)


def same_layout(t: torch.Tensor) -> torch.Tensor:
    """A private copy of ``t`` with its sizes, strides and storage offset (broadcast dimensions kept)."""
    t = t.detach()
    storage = torch.empty(
        t.storage_offset() + extent(t) if t.numel() else 0, dtype=t.dtype, device=t.device
    )
    static = storage.as_strided(t.shape, t.stride(), t.storage_offset())
    copy_into(static, t)
    return static


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A private copy of ``t`` with its sizes, strides and address alignment (broadcast dimensions
    kept). Not its storage offset: a batch sliced at offset ``i * n`` from a preloaded dataset would
    otherwise need a buffer as large as the dataset's prefix and a recording per offset. Python
    attributes set on ``t`` (a batch's tag, keyed by the signature) go with it: code reads them."""
    tags, t = t.__dict__, t.detach()
    item = t.element_size()
    align = ALIGNMENT.get(t.device.type, 512)
    storage = torch.empty(extent(t) + align // item, dtype=t.dtype, device=t.device)
    want = alignment(t)
    offset = ((want - storage.data_ptr()) % align) // item
    static = storage.as_strided(t.shape, t.stride(), offset)
    if alignment(static) != want:  # an address not a multiple of the element size
        raise ReplayError(
            f"an input at address {t.data_ptr():#x} is not aligned to its element size"
        )
    copy_into(static, t)
    if tags:
        static.__dict__.update(tags)
    return static
