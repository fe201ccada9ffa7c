"""An exponential moving average of a model's parameters that a recorded step can replay.

``AveragedModel.update_parameters`` reads a counter on the host; this is one
``_foreach_lerp_`` whose weight lives on the device (:meth:`EMA.set_decay` writes it in place),
so a replay reads the current decay where a Python float would be frozen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EMA:
    """An exponential moving average of a model's parameters, updated by one foreach lerp. Assigning
    ``source``, ``params`` or ``weights`` (an EMA reset) moves ``version``: a recorded step reads
    the tensors it held then, so the step records anew. Lists are kept as tuples, so no item can be
    replaced unseen."""

    _WATCHED = frozenset({"source", "params", "weights", "_weights"})

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.version = 0
        self.source = [p for p in model.parameters()]
        self.params = [p.detach().clone() for p in self.source]
        self._weights: dict[tuple, torch.Tensor] = {}
        for p in self.params:
            self._weights.setdefault(
                (p.dtype, p.device), torch.zeros((), dtype=p.dtype, device=p.device)
            )
        self.weights = [self._weights[(p.dtype, p.device)] for p in self.params]
        self.set_decay(decay)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("source", "params", "weights") and isinstance(value, list):
            value = tuple(value)  # no item assignment: a replaced tensor goes through here
        object.__setattr__(self, name, value)
        if name in EMA._WATCHED:
            object.__setattr__(self, "version", self.version + 1)

    def set_decay(self, decay: float) -> None:
        for w in self._weights.values():
            w.fill_(1.0 - decay)

    def update(self) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(self.params, self.source, self.weights)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self._weights.values()]
