"""Snapshot and restore of what warm-up and capture may touch: parameters, buffers, ``.grad``, RNG.

Recording runs the module several times (warm-up, capture). Those runs must leave no
trace: BatchNorm statistics, dropout's RNG stream, parameters and gradients are put
back exactly, so the call that records is bitwise equal to eager.
"""

from __future__ import annotations

import torch
from torch import nn


class StateSnapshot:
    """Values of a module's parameters and buffers, its ``.grad`` tensors and the RNG states."""

    def __init__(self, module: nn.Module) -> None:
        tensors = [*module.parameters(), *module.buffers()]
        self._values = [(t, t.detach().clone()) for t in tensors]
        self._grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
        self._cpu_rng = torch.get_rng_state()
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        self._cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices}

    def restore(self) -> None:
        """Put every value back in place (same tensor objects, no autograd version bump)."""
        with torch.no_grad():
            for t, value in self._values:
                t.data.copy_(value)
            for p, grad, value in self._grads:
                if p.grad is not grad:
                    p.grad = grad
                if grad is not None:
                    grad.data.copy_(value)
        torch.set_rng_state(self._cpu_rng)
        for device, state in self._cuda_rng.items():
            torch.cuda.set_rng_state(state, device)
