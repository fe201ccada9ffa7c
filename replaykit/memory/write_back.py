"""Write-back: the caller's tensors a recording's code writes in place, given the replay's values.

Eager code that writes its input in place (``x.sub_(x.mean(0))`` in a forward or ``loss_fn``)
changes the caller's tensor; a replay writes the static copy of it. So after each replay the
static inputs the recording call proved written (their version moved while it ran, or, for a
write through ``.data``, their storage was written or their values changed) are copied back into
the caller's tensors: the values eager leaves, and the version bumps eager's writes make
(autograd's saved-tensor check sees the write; a write through ``.data`` makes none). Only those:
a recording that writes no input has no write-back, and its replays pay one ``is None``.

It is exact when the caller's tensor is the only thing the write reaches: refused
(:func:`inexact`) for an expanded input (one element stands for many), one requiring grad
(eager records the write in its graph), one sharing memory with another argument (eager's
write shows through it, within the call, while the static copies are apart), or one on the
host beside a GPU model (a CUDA graph does not repeat a host op; refused on both backends,
as the emulated one mirrors a graph).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..verify.bitwise import bitwise_equal
from ..verify.dispatch import increment_versions

__all__ = ["ALIASED", "WriteBack", "inexact"]

#: the eager route of a call whose written argument shares memory with another
ALIASED = "written_input_aliased"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _shared(tensors: Sequence[torch.Tensor], i: int) -> bool:
    """Whether argument ``i`` shares memory with another argument that is not the same tensor."""
    x = tensors[i]
    ptr = _storage(x)
    return any(t is not x and t.numel() and _storage(t) == ptr for t in tensors)


def inexact(
    tensors: Sequence[torch.Tensor], written: Sequence[int], on_gpu: bool = False
) -> str | None:
    """Why copying the written arguments back cannot leave what eager leaves, or None. ``on_gpu``:
    the model is on a GPU, where a CUDA graph does not repeat a write to a host tensor."""
    for i in written:
        x = tensors[i]
        if on_gpu and x.device.type == "cpu":
            return f"input {i} is on the CPU beside a GPU model: a CUDA graph does not repeat a host op"
        if x.requires_grad:
            return f"input {i} requires grad: eager's autograd records the write"
        if 0 in x.stride() and x.numel() > 1:
            return f"input {i} is expanded: one element stands for many"
        if _shared(tensors, i):
            return f"input {i} shares memory with another argument: eager's write shows through it"
    return None


class WriteBack:
    """The written static inputs of one recording: one copy per distinct static (an argument passed
    twice shares one), at its first position, with the version bumps eager's writes make there."""

    __slots__ = ("_pairs", "positions")

    def __init__(self, statics: Sequence[torch.Tensor], written: Mapping[int, int]) -> None:
        pairs: list[tuple[int, torch.Tensor, int]] = []
        for i in sorted(written):
            if all(statics[i] is not s for _, s, _ in pairs):
                pairs.append((i, statics[i], written[i]))
        self._pairs = pairs
        self.positions = tuple(sorted(written))

    @classmethod
    def of(cls, statics: Sequence[torch.Tensor], written: Mapping[int, int]) -> WriteBack | None:
        """The write-back of a recording (``written``: position -> the version bumps its writes
        made), or None where it writes no input (nothing per replay)."""
        return cls(statics, written) if written else None

    def refusal(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """``written_input_aliased`` where this call's written arguments share memory with another
        (the key sees identity only): a replay would compute on copies kept apart, so the call runs
        eagerly; else None."""
        if any(_shared(tensors, i) for i in self.positions):
            return ALIASED
        return None

    def copy_back(self, tensors: Sequence[torch.Tensor], bump: bool = True) -> None:
        """The replay's written values into the caller's tensors, their versions moved as eager's
        writes move them (a write through ``.data`` moves none; ``bump=False``: moved already, by
        an eager run of the same call)."""
        with torch.no_grad():
            for i, static, bumps in self._pairs:
                x = tensors[i]
                if not bumps or not bump:
                    x.data.copy_(static)
                    continue
                x.copy_(static)  # one bump, as one in-place op
                if bumps > 1:
                    increment_versions([x] * (bumps - 1))

    def difference(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """Where an eager run of the call wrote ``tensors`` otherwise than the replay wrote the
        static copies (a checked replay), or None."""
        for i, static, _ in self._pairs:
            if not bitwise_equal(tensors[i], static):
                return f"input {i} (written in place): eager's values differ from the replay's"
        return None
