"""What a whole-step graph freezes beyond the network: optimizer, scaler and EMA host values.

A recorded step bakes every Python value its optimizer read (a float ``lr``,
``momentum``, ``betas``, ``weight_decay``), the scaler's growth settings and the clip
threshold, and it reads every state tensor (momentum buffers, Adam moments and step
counters, the scale, a tensor ``lr``) at the address it had. So:

- host values form the *hyper key*, part of each recording's key: a scheduler that
  assigns a float ``lr`` records anew (within the budget) or routes eager, never
  replays the old rate; a tensor ``lr`` updated in place (``fill_``) is read by the graph;
- state tensors are watched by address (:class:`OptimizerWatch`): ``load_state_dict``,
  a new parameter group or a replaced buffer retires the step;
- what can never replay is refused up front with a reason (:func:`refusal`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

_PTR = torch.Tensor.data_ptr


def host_value(value: Any) -> Any:
    """A hashable stand-in for one hyperparameter: floats by their bits, tensors by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))  # kept alive by the recording (see ``tensors_of``)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (list, tuple)):
        return tuple(host_value(v) for v in value)
    return value


def hyper_key(optimizer: torch.optim.Optimizer, extra: tuple = ()) -> tuple:
    """Every host value the optimizer's step reads, group by group, plus ``extra``."""
    return (
        *(tuple(host_value(v) for k, v in g.items() if k != "params") for g in optimizer.param_groups),
        *extra,
    )


def tensors_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensor hyperparameters (a tensor ``lr``): a recording keeps them alive so their ids stay theirs."""
    return [v for g in optimizer.param_groups for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)]


def state_tensors(optimizer: torch.optim.Optimizer, scaler: Any = None, extra: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """The tensors a recorded step reads and writes by address, besides the model's."""
    out = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out += tensors_of(optimizer)
    if scaler is not None:
        out += [t for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)) if t is not None]
    return out + list(extra)


class OptimizerWatch:
    """Notices state tensors replaced or new state (``load_state_dict``, ``add_param_group``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any = None, extra: Sequence[torch.Tensor] = ()) -> None:
        self._optimizer, self._scaler, self._extra = optimizer, scaler, list(extra)
        self.rebaseline()

    def rebaseline(self) -> None:
        self._state = self._optimizer.state
        self._groups = len(self._optimizer.param_groups)
        self._tensors = state_tensors(self._optimizer, self._scaler, self._extra)
        self._ptrs = list(map(_PTR, self._tensors))
        self._counts = [len(s) for s in self._state.values()]

    def reason(self) -> str | None:
        """Why recordings read stale state now, or None."""
        opt = self._optimizer
        if opt.state is not self._state or len(opt.param_groups) != self._groups:
            return "optimizer state or parameter groups replaced (load_state_dict / add_param_group)"
        if list(map(_PTR, self._tensors)) != self._ptrs or [len(s) for s in self._state.values()] != self._counts:
            return "an optimizer, scaler or EMA state tensor was replaced"
        return None


def optimizer_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Step hooks run Python around ``step()``; a replay would skip them."""
    from torch.optim import optimizer as optim_module

    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or optim_module._global_optimizer_pre_hooks
        or optim_module._global_optimizer_post_hooks
    )


def refusal(optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device) -> str | None:
    """Why this optimizer/scaler pair can never replay as a graph, or None (checked once)."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS re-evaluates a closure and reads the loss on the host"
    groups = optimizer.param_groups
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)() and not getattr(optimizer, "_step_supports_amp_scaling", False):
        return (
            f"GradScaler.step with a non-fused {name} reads found_inf on the host (.item()) to skip the step; "
            "use fused=True so the skip stays on the device"
        )
    for g in groups:
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor) and not (g.get("fused") or g.get("capturable")):
            return f"{name} with a tensor lr reads it on the host unless fused=True (or capturable=True where offered)"
    for g in groups:
        if "capturable" in g and not g["capturable"] and (device.type == "cuda" or not g.get("fused")):
            # its step counter is read on the host (.item()); on CUDA, step() also refuses a capture
            # without capturable=True, fused or not
            return f"{name} reads its step counter on the host unless capturable=True (with fused=True for speed)"
    return None


GRAD = operator.attrgetter("grad")
