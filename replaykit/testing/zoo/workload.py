"""What a zoo builder returns: a module to capture, how to make a batch, and the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

#: ``make_batch(batch_size, device, generator) -> (args, targets)``: ``module(*args)``, then ``loss(outputs, targets)``.
MakeBatch = Callable[[int, "str | torch.device", torch.Generator], tuple[tuple[Any, ...], Any]]
Loss = Callable[[Any, Any], torch.Tensor]


class Workload(NamedTuple):
    """``module`` is what a user captures; ``loss`` runs eagerly outside it (in float32)."""

    module: nn.Module
    make_batch: MakeBatch
    loss: Loss


def images(size: int, classes: int) -> MakeBatch:
    """Normal images and class labels, drawn on the CPU from ``generator`` (the same on every device)."""

    def make(
        batch: int, device: str | torch.device, g: torch.Generator
    ) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        x = torch.randn(batch, 3, size, size, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return (x.to(device),), y.to(device)

    return make


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)
