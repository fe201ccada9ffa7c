"""Pose: keypoint locations with a Laplace scale, and keypoint visibility."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replaykit.testing.tasks.base import TaskModule, backbone
from replaykit.testing.tasks.data import CHANNELS, NUM_KEYPOINTS, Batch

LOG_SCALE_RANGE = (-6.0, 6.0)


class PoseNet(nn.Module):
    """Backbone, global average pool, a hidden layer with dropout, three linear heads."""

    def __init__(self, num_keypoints: int = NUM_KEYPOINTS, width: int = 16, dropout: float = 0.1):
        super().__init__()
        self.k = num_keypoints
        self.backbone = backbone(CHANNELS, width)
        self.hidden = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Dropout(dropout))
        self.kpt = nn.Linear(2 * width, 2 * num_keypoints)
        self.kpt_log_b = nn.Linear(2 * width, 2 * num_keypoints)
        self.kpt_vis = nn.Linear(2 * width, num_keypoints)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.hidden(self.backbone(x).mean(dim=(2, 3)))
        return {
            "kpt": self.kpt(h).unflatten(1, (self.k, 2)),
            "kpt_log_b": self.kpt_log_b(h).unflatten(1, (self.k, 2)),
            "kpt_vis": self.kpt_vis(h),
        }


def laplace_nll(mu: torch.Tensor, log_b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Elementwise Laplace negative log-likelihood without the constant ``log 2``.

    The log-scale is clamped to ``LOG_SCALE_RANGE`` so ``exp(-log_b)`` stays finite.
    """
    log_b = log_b.clamp(*LOG_SCALE_RANGE)
    return log_b + (x - mu).abs() * torch.exp(-log_b)


class PoseTask(TaskModule):
    """Laplace NLL of visible keypoints plus a BCE visibility term."""

    def __init__(
        self,
        *,
        num_keypoints: int = NUM_KEYPOINTS,
        width: int = 16,
        dropout: float = 0.1,
        **kw,
    ) -> None:
        super().__init__(**kw)
        self.net = PoseNet(num_keypoints, width, dropout)

    def losses(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        vis = batch["vis"]
        nll = laplace_nll(out["kpt"], out["kpt_log_b"], batch["kpt"]).sum(-1)
        return {
            "kpt_nll": (nll * vis).sum() / vis.sum().clamp(min=1.0),
            "kpt_vis": F.binary_cross_entropy_with_logits(out["kpt_vis"], vis),
        }

    def metrics(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        vis = batch["vis"]
        err = (out["kpt"] - batch["kpt"]).abs().mean(-1)
        return {"kpt_l1": (err * vis).sum() / vis.sum().clamp(min=1.0)}
