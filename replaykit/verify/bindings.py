"""The storages a module's parameters and buffers are bound to, as the probe's forward found them.

Two things no replay repeats are seen there. A forward that rebinds a tensor's ``.data``
(MoCo's momentum encoder, ``pk.data = pk.data * m + pq.data * (1 - m)``) keeps the Parameter
object and moves no version counter: the probe's write watch and the snapshots' copies miss it,
each of the recording call's runs applies it again, and a replay never does. A forward that
returns a parameter or buffer (a VQ-VAE's EMA codebook, CLIP's ``logit_scale``) hands eager's
caller the module's own tensor, which a kept reference follows; a replay hands out memory of
its own, which freezes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Bindings"]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Bindings:
    """Taken before the probe's forward: each parameter (its stand-in where ``params`` has one)
    and buffer, by name, with an alias of the storage it is bound to. ``rebinds`` / ``outputs``:
    which of the two refusals are looked for (the ``data_rebind`` / ``output_state`` protections)."""

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        leaves: Sequence[torch.Tensor],
        checks: tuple[bool, bool] = (True, True),
    ) -> None:
        self._rebinds, self._outputs = checks
        self.rebound: str | None = None  # the first tensor the forward rebound, by name
        self._name = type(module).__name__
        stand_in = {id(p): leaf for p, leaf in zip(params, leaves, strict=True)}
        named = [
            (n, stand_in.get(id(t), t))
            for n, t in (*module.named_parameters(), *module.named_buffers())
        ]
        # an alias keeps the storage found (a rebound tensor is bound back to it)
        self._named = [
            (n, t, t.data if self._rebinds else t)
            for n, t in named
            if t.numel() and t.layout == torch.strided and t.device.type != "meta"
        ]

    def __enter__(self) -> Bindings:
        return self

    def __exit__(self, *exc: object) -> None:
        """Bind every tensor the forward rebound back to the storage it had (the caller's snapshot
        then copies the values back into it); ``rebound``: the first one's name."""
        if not self._rebinds:
            return
        for name, t, alias in self._named:
            if _storage(t) != _storage(alias):
                with torch.no_grad():
                    t.data = alias
                self.rebound = self.rebound or name

    def returned(self, tensors: Sequence[torch.Tensor]) -> tuple[int, str] | None:
        """The first output sharing a parameter's or buffer's memory (a view of it), with its name."""
        if not self._outputs:
            return None
        state = {_storage(t): n for n, t, _ in self._named}
        for i, o in enumerate(tensors):
            if o.numel() and o.layout == torch.strided and o.device.type != "meta":
                name = state.get(_storage(o))
                if name is not None:
                    return i, f"{self._name}.{name}"
        return None

    def qualified(self, name: str) -> str:
        return f"{self._name}.{name}"
