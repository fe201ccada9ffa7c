"""Outputs the caller keeps: an epoch metric's predictions, a list of losses, the cache a model returns.

A replay writes its outputs into the recording's static buffers; what the caller kept from an
earlier call (``preds.append(logits.detach())``, a view of it, a cache object holding the
call's keys) would change under it at the next replay. Copy-out moves whatever still shares
those buffers, every holder at once, to memory of its own before the replay
(``replaykit/memory/copy_out.py``), so these loops replay; without it (``live_outputs``
switched off) the kept tensors end with a later call's values. A model returning an object
(transformers' ``ModelOutput`` with a ``DynamicCache``) gets a new instance per call, rebuilt
around the replayed tensors (``replaykit/memory/outputs.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from .pattern import MLP, Arm, Extras, Pattern, sgd
from .writing import HazardClass, built

HAZARD = "kept_outputs"
HC = HazardClass(HAZARD)


class Scored(MLP):
    """An MLP returning its loss beside its logits, as transformers' models do (``labels`` in)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return {"loss": logits.square().mean(), "logits": logits}


class KeyCache:
    """Per-layer keys and values of one call, like transformers' ``DynamicLayer``s in a ``DynamicCache``."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.seen = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys.append(k)
        self.values.append(v)
        self.seen += k.shape[-2]


class Cached(nn.Module):
    """Two attention-like layers whose keys and values go into a cache object it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 12) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        cache = KeyCache()
        for layer in self.layers:
            k, v = layer(x).chunk(2, dim=-1)
            cache.update(k, v)
            x = x + torch.softmax(k @ v.transpose(-1, -2), dim=-1) @ v
        logits = self.head(x)
        return {"loss": logits.square().mean(), "logits": logits, "past_key_values": cache}


def _epoch(model: nn.Module, arm: Arm, keep: str, steps: int = 5) -> Extras:
    """An epoch: train each batch, keep what an epoch metric reads at the end (``keep``)."""
    opt = sgd(model)
    kept: Extras = {}
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(arm.randn(4, 5, 6) if isinstance(model, Cached) else arm.randn(4, 6))
        out["loss"].backward()
        opt.step()
        if keep == "logits":
            kept[f"pred{i}"] = out["logits"].detach()
        elif (
            keep == "argmax_view"
        ):  # a view of the kept tensor: copy-out cannot reach it by the output
            kept[f"top{i}"] = out["logits"].detach()[:, 0]
        elif keep == "losses":
            kept[f"loss{i}"] = out["loss"].detach()
        else:  # the cache objects, as a generation warm-start keeps them
            cache = out["past_key_values"]
            kept[f"cache{i}/k0"], kept[f"cache{i}/v1"] = cache.keys[0], cache.values[1]
            kept[f"cache{i}/seen"] = torch.tensor(cache.seen)
            kept[f"cache{i}/type"] = torch.tensor(type(cache) is KeyCache)
    return kept


def _step_epoch(model: nn.Module, arm: Arm, steps: int = 5) -> Extras:
    """The same epoch as one ``rk.TrainStep`` per batch: the losses it hands back, kept."""
    step = arm.train_step(model, lambda m, x: m(x)["loss"], sgd(model))
    shape = (4, 5, 6) if isinstance(model, Cached) else (4, 6)
    return {f"loss{i}": step(arm.randn(*shape)) for i in range(steps)}


def _kept(name: str, what: str, model: type[nn.Module], keep: str) -> Pattern:
    """A capture pattern whose epoch keeps ``keep`` (:func:`_epoch`); copy-out is what it needs."""
    return HC.pattern(
        name, what, built(model), lambda m, a: _epoch(m, a, keep), guard="live_outputs"
    )


PATTERNS: list[Pattern] = [
    _kept(
        "epoch_metric_keeps_logits",
        "preds.append(logits.detach()) every step for an epoch metric",
        Scored,
        "logits",
    ),
    _kept(
        "epoch_metric_keeps_a_view",
        "keeps a column of the detached logits (a view sharing the output's memory)",
        Scored,
        "argmax_view",
    ),
    _kept(
        "keeps_the_models_losses",
        "a list of the model's own losses (model(**batch).loss) kept as tensors",
        Scored,
        "losses",
    ),
    _kept(
        "returns_a_cache_object",
        "the model returns a cache object holding each layer's keys and values; the loop keeps them",
        Cached,
        "cache",
    ),
    HC.pattern(
        "step_keeps_its_losses",
        "the losses rk.TrainStep hands back, kept as tensors for the epoch's mean",
        built(Scored),
        _step_epoch,
        api="step",
    ),
    HC.pattern(
        "step_model_returns_a_cache_object",
        "loss_fn reads the loss of a model that also returns a cache object",
        built(Cached),
        _step_epoch,
        api="step",
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
