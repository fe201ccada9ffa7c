"""A RetinaNet the way users capture one: backbone + FPN + head replayed, the loss eager.

The loss matches anchors to a random number of boxes per image (IoU, ``Matcher``,
boolean masks: data-dependent shapes a graph cannot hold), so it stays outside the
captured module, as in a user's training step. Images are 128 px, so no convolution
of the FPN sees a 1x1 input (torch 2.13's CPU bf16 convolution backward reads
uninitialised memory for a 3x3/stride-2 kernel over a 1x1 input: eager does not repeat
itself there).
"""

from __future__ import annotations

import torch
from torch import nn

from . import deps
from .workload import Workload

CLASSES = 3
IMAGE = 128


class DenseDetector(nn.Module):
    """What is captured: the backbone with its FPN, and the RetinaNet head over every level."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.head(list(self.backbone(images).values()))


def retinanet() -> Workload:
    """ResNet-18 trunk, a 32-channel FPN with P6/P7, RetinaNet's shared classification and box heads."""
    tv = deps.torchvision()
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.models.detection.image_list import ImageList
    from torchvision.models.detection.retinanet import RetinaNet, RetinaNetHead
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    width = 32
    backbone = BackboneWithFPN(
        tv.models.resnet18(),
        {"layer2": "0", "layer3": "1", "layer4": "2"},
        [128, 256, 512],
        width,
        extra_blocks=LastLevelP6P7(width, width),
    )
    anchors = AnchorGenerator(tuple((s,) for s in (16, 32, 64, 128, 256)), ((0.5, 1.0, 2.0),) * 5)
    detector = RetinaNet(
        backbone,
        num_classes=CLASSES,
        anchor_generator=anchors,
        head=RetinaNetHead(width, anchors.num_anchors_per_location()[0], CLASSES),
    )
    dense = DenseDetector(detector.backbone, detector.head)
    strides = (8, 16, 32, 64, 128)  # C3-C5, P6, P7
    sizes = [((IMAGE + s - 1) // s,) * 2 for s in strides]

    def make(batch: int, device, g: torch.Generator):
        x = torch.rand(batch, 3, IMAGE, IMAGE, generator=g)
        targets = []
        for _ in range(batch):
            n = int(torch.randint(1, 4, (1,), generator=g))
            corner = torch.rand(n, 2, generator=g) * (IMAGE - 48)
            size = 12 + torch.rand(n, 2, generator=g) * 36
            boxes = torch.cat([corner, corner + size], 1)
            targets.append(
                {
                    "boxes": boxes.to(device),
                    "labels": torch.randint(0, CLASSES, (n,), generator=g).to(device),
                }
            )
        return (x.to(device),), targets

    def loss(out: dict[str, torch.Tensor], targets: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        logits = out["cls_logits"]
        n, device = logits.shape[0], logits.device
        levels = [torch.empty(n, 0, h, w, device=device) for h, w in sizes]  # shapes only
        images = ImageList(torch.empty(n, 3, IMAGE, IMAGE, device=device), [(IMAGE, IMAGE)] * n)
        parts = detector.compute_loss(
            targets, {k: v.float() for k, v in out.items()}, anchors(images, levels)
        )
        return parts["classification"] + parts["bbox_regression"]

    return Workload(dense, make, loss)
