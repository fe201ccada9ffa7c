"""Detection: dense one-to-many and one-to-one heads (``o2m_*``, ``o2o_*``) on a conv backbone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaykit.testing.tasks.base import TaskModule, backbone, conv_bn
from replaykit.testing.tasks.data import CHANNELS, NUM_CLASSES, Batch


class BranchedDetectionNet(nn.Module):
    """Backbone, then two branches (one-to-many, one-to-one), each with a cls and a box head."""

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 16, dropout: float = 0.0):
        super().__init__()
        self.backbone = backbone(CHANNELS, width)
        self.dropout = nn.Dropout(dropout)
        self.o2m = conv_bn(width, width)
        self.o2o = conv_bn(width, width)
        self.o2m_cls = nn.Conv2d(width, num_classes, 1)
        self.o2m_box = nn.Conv2d(width, 4, 1)
        self.o2o_cls = nn.Conv2d(width, num_classes, 1)
        self.o2o_box = nn.Conv2d(width, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.dropout(self.backbone(x))
        many, one = self.o2m(f), self.o2o(f)
        return {
            "o2m_cls": self.o2m_cls(many),
            "o2m_box": self.o2m_box(many),
            "o2o_cls": self.o2o_cls(one),
            "o2o_box": self.o2o_box(one),
        }


def _masked_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


class DetectionTask(TaskModule):
    """BCE classification and smooth-L1 box regression over all four heads."""

    def __init__(
        self, *, num_classes: int = NUM_CLASSES, width: int = 16, dropout: float = 0.0, **kw
    ) -> None:
        super().__init__(**kw)
        self.net = BranchedDetectionNet(num_classes, width, dropout)

    def losses(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        many, one = batch["o2m_cls"], batch["o2o_cls"]
        box = batch["box"]
        box_many = F.smooth_l1_loss(out["o2m_box"], box, reduction="none").sum(1)
        box_one = F.smooth_l1_loss(out["o2o_box"], box, reduction="none").sum(1)
        return {
            "o2m_cls": F.binary_cross_entropy_with_logits(out["o2m_cls"], many),
            "o2m_box": _masked_mean(box_many, many.amax(1)),
            "o2o_cls": F.binary_cross_entropy_with_logits(out["o2o_cls"], one),
            "o2o_box": _masked_mean(box_one, one.amax(1)),
        }

    def metrics(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        one = batch["o2o_cls"].amax(1)
        return {"box_l1": _masked_mean((out["o2o_box"] - batch["box"]).abs().mean(1), one)}
