"""torchvision classifiers and segmentation, built from code (no weights), at tiny sizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import deps
from .workload import Workload, cross_entropy, images

CLASSES = 10
IMAGE = 32


def resnet18() -> Workload:
    """BatchNorm, residual blocks, max pooling."""
    return Workload(
        deps.torchvision().models.resnet18(num_classes=CLASSES),
        images(IMAGE, CLASSES),
        cross_entropy,
    )


def mobilenet_v3_small() -> Workload:
    """Depthwise convolutions, squeeze-excitation (hardsigmoid), hardswish, dropout in the classifier."""
    tv = deps.torchvision()
    return Workload(
        tv.models.mobilenet_v3_small(num_classes=CLASSES), images(IMAGE, CLASSES), cross_entropy
    )


def convnext() -> Workload:
    """ConvNeXt blocks (7x7 depthwise, LayerNorm2d, layer scale) with stochastic depth, two small stages."""
    tv = deps.torchvision()
    from torchvision.models.convnext import CNBlockConfig

    net = tv.models.ConvNeXt(
        [CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)],
        stochastic_depth_prob=0.2,
        num_classes=CLASSES,
    )
    return Workload(net, images(IMAGE, CLASSES), cross_entropy)


def vit() -> Workload:
    """A ViT: patch embedding, class token, nn.MultiheadAttention (SDPA inside) with attention dropout."""
    tv = deps.torchvision()
    net = tv.models.VisionTransformer(
        image_size=IMAGE,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        dropout=0.1,
        attention_dropout=0.1,
        num_classes=CLASSES,
    )
    return Workload(net, images(IMAGE, CLASSES), cross_entropy)


def swin() -> Workload:
    """A Swin: shifted windows (torch.roll, an attention mask built in forward), a relative position bias
    gathered by an integer index buffer, stochastic depth and dropout."""
    tv = deps.torchvision()
    net = tv.models.SwinTransformer(
        patch_size=[2, 2],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[4, 4],
        stochastic_depth_prob=0.2,
        dropout=0.1,
        attention_dropout=0.1,
        num_classes=CLASSES,
    )
    return Workload(net, images(IMAGE, CLASSES), cross_entropy)


SEG_CLASSES = 3
SEG_IMAGE = 64


def lraspp() -> Workload:
    """torchvision's LRASPP segmentation head on MobileNetV3-Large; returns {"out": logits} upsampled to the input."""
    tv = deps.torchvision()
    net = tv.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=SEG_CLASSES
    )

    def make(batch: int, device, g: torch.Generator):
        x = torch.randn(batch, 3, SEG_IMAGE, SEG_IMAGE, generator=g)
        y = torch.randint(0, SEG_CLASSES, (batch, SEG_IMAGE, SEG_IMAGE), generator=g)
        return (x.to(device),), y.to(device)

    return Workload(net, make, lambda out, y: F.cross_entropy(out["out"].float(), y))
