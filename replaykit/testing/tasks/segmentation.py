"""Segmentation: a decoder that fuses a high-resolution feature route, mask heads, a cls head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaykit.testing.tasks.base import TaskModule, conv_bn
from replaykit.testing.tasks.data import CHANNELS, NUM_CLASSES, STRIDE, Batch


class SegmentationNet(nn.Module):
    """Outputs ``mask`` (full resolution), ``aux_mask`` (stride 4) and ``cls`` logits.

    The stride-2 features take a route around the deep stage into the decoder. Upsampling
    is by transposed convolution, which has deterministic CUDA kernels (bilinear
    interpolation's backward does not).
    """

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 16, dropout: float = 0.1):
        super().__init__()
        half = width // 2
        self.stem = conv_bn(CHANNELS, half, 2)  # the feature route, stride 2
        self.deep = nn.Sequential(conv_bn(half, width, 2), conv_bn(width, width))  # stride 4
        self.dropout = nn.Dropout(dropout)
        self.up = nn.ConvTranspose2d(width, half, 2, 2)
        self.fuse = conv_bn(2 * half, half)
        self.mask = nn.ConvTranspose2d(half, num_classes, 2, 2)
        self.aux_mask = nn.Conv2d(width, num_classes, 1)
        self.cls = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        route = self.stem(x)
        deep = self.dropout(self.deep(route))
        fused = self.fuse(torch.cat((self.up(deep), route), dim=1))
        return {
            "mask": self.mask(fused),
            "aux_mask": self.aux_mask(deep),
            "cls": self.cls(deep.mean(dim=(2, 3))),
        }


def dice_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - soft Dice over each sample and class, averaged, with +1 smoothing."""
    p = torch.sigmoid(logits)
    inter = (p * target).sum(dim=(2, 3))
    total = p.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
    return (1.0 - (2.0 * inter + 1.0) / (total + 1.0)).mean()


class SegmentationTask(TaskModule):
    """Mask BCE + Dice, an auxiliary coarse-mask BCE, and a BCE presence (cls) term."""

    def __init__(
        self, *, num_classes: int = NUM_CLASSES, width: int = 16, dropout: float = 0.1, **kw
    ) -> None:
        super().__init__(**kw)
        self.net = SegmentationNet(num_classes, width, dropout)

    def losses(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        mask = batch["mask"]
        coarse = F.avg_pool2d(mask, STRIDE)
        return {
            "mask_bce": F.binary_cross_entropy_with_logits(out["mask"], mask),
            "mask_dice": dice_loss(out["mask"], mask),
            "aux_mask": 0.5 * F.binary_cross_entropy_with_logits(out["aux_mask"], coarse),
            "cls": F.binary_cross_entropy_with_logits(out["cls"], batch["present"]),
        }

    def metrics(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        return {"dice": 1.0 - dice_loss(out["mask"], batch["mask"])}
