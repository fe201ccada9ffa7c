"""Small networks that exercise replay: a four-head detection net and a dropout net."""

from __future__ import annotations

import torch
from torch import nn

DETECTION_HEADS: tuple[str, ...] = ("o2m_cls", "o2m_box", "o2o_cls", "o2o_box")


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
    )


class DetectionNet(nn.Module):
    """Conv backbone with BatchNorm and four heads, like a one-to-many/one-to-one detector."""

    def __init__(
        self, width: int = 16, depth: int = 3, classes: int = 4, in_channels: int = 3
    ) -> None:
        super().__init__()
        layers = [_block(in_channels, width)] + [_block(width, width) for _ in range(depth - 1)]
        self.backbone = nn.Sequential(*layers)
        self.o2m_cls = nn.Conv2d(width, classes, 1)
        self.o2m_box = nn.Conv2d(width, 4, 1)
        self.o2o_cls = nn.Conv2d(width, classes, 1)
        self.o2o_box = nn.Conv2d(width, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        return {name: getattr(self, name)(f) for name in DETECTION_HEADS}


class DropoutNet(nn.Module):
    """An MLP with dropout: its replay must draw the same masks as eager."""

    def __init__(self, width: int = 32, p: float = 0.3, in_features: int = 12) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(in_features, width),
            nn.ReLU(),
            nn.Dropout(p),
            nn.Linear(width, width),
            nn.Dropout(p),
        )
        self.cls = nn.Linear(width, 3)
        self.box = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.cls(h), self.box(h)
