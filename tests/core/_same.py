"""Bitwise equality of what a training loop kept (nested lists and tuples of tensors, None and
plain values): the parity tests' one comparison."""

from __future__ import annotations

import torch

from replaykit.verify.bitwise import bitwise_equal


def same(a: object, b: object) -> bool:
    """Tensors by bits, dtype and shape (None only matches None); sequences item by item; the
    rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a is None or b is None:
        return (
            (a is None or isinstance(a, torch.Tensor))
            and (b is None or isinstance(b, torch.Tensor))
            and bitwise_equal(a, b)
        )  # type: ignore[arg-type]
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b
