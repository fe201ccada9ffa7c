"""What a zoo builder returns: a module to capture, how to make a batch, and the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

#: ``make_batch(batch_size, device, generator) -> (args, targets)``: ``invoke(module, args)``, then
#: ``loss(outputs, targets)``. ``args`` is a tuple of positional arguments, or a dict of keyword
#: arguments (transformers: ``model(**batch)``, the labels inside and ``targets`` None).
MakeBatch = Callable[
    [int, "str | torch.device", torch.Generator],
    tuple["tuple[Any, ...] | dict[str, Any]", Any],
]
Loss = Callable[[Any, Any], torch.Tensor]


class Workload(NamedTuple):
    """``module`` is what a user captures; ``loss`` runs eagerly outside it (in float32)."""

    module: nn.Module
    make_batch: MakeBatch
    loss: Loss


def invoke(module: Callable[..., Any], args: tuple[Any, ...] | dict[str, Any]) -> Any:
    """Call ``module`` with a batch's arguments: keyword arguments for a dict, else positional."""
    return module(**args) if isinstance(args, dict) else module(*args)


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
