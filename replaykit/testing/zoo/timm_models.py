"""timm's own tiny test models, built with ``pretrained=False`` (timm is optional)."""

from __future__ import annotations

from . import deps
from .workload import Workload, cross_entropy, images

CLASSES = 10


def _timm(arch: str, image: int = 32, **kw: object) -> Workload:
    net = deps.timm().create_model(
        arch, pretrained=False, num_classes=CLASSES, drop_rate=0.1, drop_path_rate=0.1, **kw
    )
    return Workload(net, images(image, CLASSES), cross_entropy)


def efficientnet() -> Workload:
    """timm ``test_efficientnet``: MBConv blocks, squeeze-excitation, SiLU, drop path."""
    return _timm("test_efficientnet")


def convnext() -> Workload:
    """timm ``test_convnext``: ConvNeXt blocks with timm's LayerNorm2d and drop path."""
    return _timm("test_convnext")


def vit() -> Workload:
    """timm ``test_vit``: timm's Attention (F.scaled_dot_product_attention), drop path.

    Built for the 32 px input: at its default size the position embedding is resampled
    every call (bicubic with antialias), whose CUDA backward has no deterministic kernel,
    so eager could not repeat itself on the H200.
    """
    return _timm("test_vit", img_size=32)
