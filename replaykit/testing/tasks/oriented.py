"""Oriented boxes: dense class, box and angle heads; the angle is learnt as (sin 2θ, cos 2θ)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaykit.testing.tasks.base import TaskModule, backbone, conv_bn
from replaykit.testing.tasks.data import CHANNELS, NUM_CLASSES, Batch


class OrientedNet(nn.Module):
    """Backbone, one shared branch, heads ``obb_cls``, ``obb_box`` and ``obb_angle``."""

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 16, dropout: float = 0.0):
        super().__init__()
        self.backbone = backbone(CHANNELS, width)
        self.branch = nn.Sequential(conv_bn(width, width), nn.Dropout(dropout))
        self.obb_cls = nn.Conv2d(width, num_classes, 1)
        self.obb_box = nn.Conv2d(width, 4, 1)
        self.obb_angle = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.branch(self.backbone(x))
        return {
            "obb_cls": self.obb_cls(f),
            "obb_box": self.obb_box(f),
            "obb_angle": self.obb_angle(f),
        }


def angle_target(theta: torch.Tensor) -> torch.Tensor:
    """(sin 2θ, cos 2θ) on a new dim 1: continuous across the θ ≡ θ + π symmetry of a box."""
    return torch.stack((torch.sin(2 * theta), torch.cos(2 * theta)), dim=1)


class OrientedTask(TaskModule):
    """BCE classification, L1 box and squared sin/cos angle error at the object cells."""

    def __init__(
        self, *, num_classes: int = NUM_CLASSES, width: int = 16, dropout: float = 0.0, **kw
    ) -> None:
        super().__init__(**kw)
        self.net = OrientedNet(num_classes, width, dropout)

    def losses(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        pos = batch["cls"].amax(1)
        denom = pos.sum().clamp(min=1.0)
        box = F.l1_loss(out["obb_box"], batch["box"], reduction="none").sum(1)
        angle = (out["obb_angle"] - angle_target(batch["angle"])).square().sum(1)
        return {
            "obb_cls": F.binary_cross_entropy_with_logits(out["obb_cls"], batch["cls"]),
            "obb_box": (box * pos).sum() / denom,
            "obb_angle": (angle * pos).sum() / denom,
        }

    def metrics(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        pos = batch["cls"].amax(1)
        pred, target = out["obb_angle"], angle_target(batch["angle"])
        cos = (pred * target).sum(1) / pred.norm(dim=1).clamp(min=1e-6)
        return {"angle_err": ((1.0 - cos) * pos).sum() / pos.sum().clamp(min=1.0)}
