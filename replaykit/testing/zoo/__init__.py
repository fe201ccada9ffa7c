"""The model zoo: networks users capture but did not write, each with synthetic data and a loss.

    from replaykit.testing import zoo
    module, make_batch, loss = zoo.build("resnet18")
    args, targets = make_batch(4, "cpu", torch.Generator().manual_seed(0))
    loss(zoo.invoke(module, args), targets).backward()

``MODELS`` maps a name to a :class:`ZooModel`, whose ``build()`` returns a
:class:`~replaykit.testing.zoo.workload.Workload` ``(module, make_batch, loss)``. Everything is
built from code at a tiny size (no weights are downloaded). torchvision, timm and
transformers are imported only when a model that needs them is built (:mod:`.deps`); a
model whose package is missing is reported by :func:`unavailable`, never silently dropped.
The transformers models (``hf_*``, :mod:`.hf`) take keyword arguments (``model(**batch)``,
see :func:`~replaykit.testing.zoo.workload.invoke`); ``"transformers"`` names their tiny
configs, ``"transformers_small"`` their small ones.
:mod:`.run` trains each model eagerly and under replay and compares them bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from . import deps, detection, hf, language, timm_models, vision
from .workload import Workload, invoke


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: what it is, what it exercises, what it needs, and the benchmark's batch sizes."""

    name: str
    source: str  # "torchvision", "timm" or "torch"
    exercises: str
    builder: Callable[[], Workload]
    needs: tuple[str, ...] = ()
    batches: tuple[int, ...] = (8, 32)  # the benchmark's batches (small, medium)

    def build(self) -> Workload:
        return self.builder()

    __call__ = build


_TV = ("torchvision",)
_TIMM = ("torchvision", "timm")
_HF = ("transformers",)


def _transformers() -> list[ZooModel]:
    """Each family at its tiny config (``hf_gpt2``) and its small one (``hf_gpt2_small``)."""
    return [
        ZooModel(
            f"hf_{family}{'' if size == 'tiny' else '_' + size}",
            "transformers",
            f"{exercises} ({size} config)",
            partial(builder, size),
            _HF,
            batches=(8,),
        )
        for size in hf.SIZES
        for family, (builder, exercises) in hf.FAMILIES.items()
    ]


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("resnet18", "torchvision", "BatchNorm, residual blocks", vision.resnet18, _TV),
        ZooModel(
            "mobilenet_v3_small",
            "torchvision",
            "depthwise convs, SE blocks, hardswish, dropout",
            vision.mobilenet_v3_small,
            _TV,
        ),
        ZooModel(
            "convnext",
            "torchvision",
            "7x7 depthwise convs, LayerNorm2d, layer scale, stochastic depth",
            vision.convnext,
            _TV,
        ),
        ZooModel(
            "vit",
            "torchvision",
            "nn.MultiheadAttention (SDPA), attention dropout, class token",
            vision.vit,
            _TV,
        ),
        ZooModel(
            "swin",
            "torchvision",
            "shifted windows, relative position bias (index gather), stochastic depth",
            vision.swin,
            _TV,
        ),
        ZooModel(
            "lraspp",
            "torchvision",
            "segmentation: MobileNetV3-Large, LRASPP head, upsampling, dict output",
            vision.lraspp,
            _TV,
            batches=(4, 16),
        ),
        ZooModel(
            "retinanet",
            "torchvision",
            "detection: backbone+FPN+shared head captured, anchor-matching loss eager",
            detection.retinanet,
            _TV,
            batches=(2, 8),
        ),
        ZooModel(
            "transformer_lm",
            "torch",
            "nn.TransformerEncoder, causal mask, tied embeddings, dropout",
            language.transformer_lm,
            (),
            batches=(8, 64),
        ),
        ZooModel(
            "timm_efficientnet",
            "timm",
            "timm MBConv, SE, SiLU, drop path",
            timm_models.efficientnet,
            _TIMM,
        ),
        ZooModel(
            "timm_convnext",
            "timm",
            "timm ConvNeXt, LayerNorm2d, drop path",
            timm_models.convnext,
            _TIMM,
        ),
        ZooModel(
            "timm_vit", "timm", "timm Attention (fused SDPA), drop path", timm_models.vit, _TIMM
        ),
        *_transformers(),
    )
}

#: Names that stand for several models in :func:`names`.
GROUPS: dict[str, tuple[str, ...]] = {
    "transformers": tuple(f"hf_{f}" for f in hf.FAMILIES),
    "transformers_small": tuple(f"hf_{f}_small" for f in hf.FAMILIES),
}

#: The notebooks' default: two small models, quick on a CPU.
DEFAULT: tuple[str, ...] = ("resnet18", "transformer_lm")


def names(chosen: Iterable[str] = DEFAULT) -> list[str]:
    """The chosen names in registry order; ``"all"`` stands for every model, a :data:`GROUPS` name for
    its models. Unknown names raise."""
    chosen = list(chosen)
    if "all" in chosen:
        return list(MODELS)
    chosen = [m for n in chosen for m in GROUPS.get(n, (n,))]
    unknown = [n for n in chosen if n not in MODELS]
    if unknown:
        raise ValueError(
            f"unknown zoo model(s) {unknown}; choose from {', '.join(MODELS)}, {', '.join(GROUPS)} or 'all'"
        )
    return [n for n in MODELS if n in chosen]


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot be built here (a missing package), or None."""
    for package in MODELS[name].needs:
        why = deps.missing(package)
        if why:
            return why
    return None


def build(name: str) -> Workload:
    """A fresh ``(module, make_batch, loss)`` for ``name`` (seed torch first for identical weights)."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name].build()


__all__ = [
    "DEFAULT",
    "GROUPS",
    "MODELS",
    "Workload",
    "ZooModel",
    "build",
    "invoke",
    "names",
    "unavailable",
]
