"""The full end state of a training run, as a flat dict of CPU tensors to compare bitwise.

Keys (``<name>`` is a parameter's or buffer's qualified name in the module)::

    param/<name>                       every parameter
    buffer/<name>                      every buffer (BatchNorm statistics, num_batches_tracked)
    grad/<name>                        every parameter's .grad, None kept as None
    optim/<i>/<name>/<key>             optimizer i's per-parameter state
    optim/<i>/group<j>/<key>           optimizer i's group j hyper-parameters (lr, momentum, ...)
    sched/<i>/<key>                    LR scheduler i's numeric state (last_epoch, _last_lr/<k>, ...)
    scaler/<key>                       the GradScaler's state (scale, _growth_tracker, ...)
    ema/<name>                         the module's ``ema_state`` entries, if it has any
    logged/<key>                       trainer.callback_metrics, then trainer.logged_metrics
    progress/global_step, progress/current_epoch

Numbers become 0-d tensors (float64 for floats, int64 for ints, bool for bools); lists and
tuples get one key per entry (``<key>/<k>``), dicts one per item. Strings are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
import torch
from torch import nn

from replaykit.verify.bitwise import bitwise_equal

State = dict[str, torch.Tensor | None]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _flatten(prefix: str, value: Any, out: State) -> None:
    """Add ``value`` under ``prefix``: tensors copied to CPU, numbers as 0-d tensors, None as None."""
    if isinstance(value, torch.Tensor):
        out[prefix] = _cpu(value)
    elif value is None:
        out[prefix] = None
    elif isinstance(value, bool):
        out[prefix] = torch.tensor(value, dtype=torch.bool)
    elif isinstance(value, int):
        out[prefix] = torch.tensor(value, dtype=torch.int64)
    elif isinstance(value, float):
        out[prefix] = torch.tensor(value, dtype=torch.float64)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(f"{prefix}/{key}", item, out)
    elif isinstance(value, list | tuple):
        for k, item in enumerate(value):
            _flatten(f"{prefix}/{k}", item, out)
    # strings, callables and other objects carry no numeric state


def module_state(module: nn.Module) -> State:
    """``param/``, ``buffer/`` and ``grad/`` entries of ``module``."""
    out: State = {}
    for name, p in module.named_parameters():
        out[f"param/{name}"] = _cpu(p)
    for name, b in module.named_buffers():
        out[f"buffer/{name}"] = _cpu(b)
    for name, p in module.named_parameters():
        out[f"grad/{name}"] = None if p.grad is None else _cpu(p.grad)
    return out


def optimizer_state(
    optimizers: Iterable[torch.optim.Optimizer], names: Mapping[int, str] | None = None
) -> State:
    """``optim/`` entries; ``names`` maps ``id(param)`` to its name (else ``g<j>.<k>``)."""
    names = names or {}
    out: State = {}
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key != "params":
                    _flatten(f"optim/{i}/group{j}/{key}", value, out)
            for k, p in enumerate(group["params"]):
                name = names.get(id(p), f"g{j}.{k}")
                for key, value in opt.state.get(p, {}).items():
                    _flatten(f"optim/{i}/{name}/{key}", value, out)
    return out


def scheduler_state(schedulers: Iterable[Any]) -> State:
    """``sched/`` entries from each scheduler's ``state_dict()``."""
    out: State = {}
    for i, sched in enumerate(schedulers):
        _flatten(f"sched/{i}", sched.state_dict(), out)
    return out


def scaler_state(scaler: Any) -> State:
    """``scaler/`` entries: ``state_dict()``, with ``scale`` and ``_growth_tracker`` as the
    scaler's own tensors (exact dtype) once it has made them."""
    out: State = {}
    if scaler is None:
        return out
    _flatten("scaler", scaler.state_dict(), out)
    for key, attr in (("scale", "_scale"), ("_growth_tracker", "_growth_tracker")):
        value = getattr(scaler, attr, None)
        if isinstance(value, torch.Tensor):
            out[f"scaler/{key}"] = _cpu(value)
    return out


def _attached_trainer(module: nn.Module) -> L.Trainer | None:
    try:
        return module.trainer  # raises when a LightningModule has no trainer
    except (AttributeError, RuntimeError):
        return None


def snapshot(
    module: nn.Module,
    trainer: L.Trainer | None = None,
    *,
    optimizers: Iterable[torch.optim.Optimizer] | None = None,
    schedulers: Iterable[Any] | None = None,
    scaler: Any = None,
) -> State:
    """The end state of ``module``'s training, cloned to CPU; see the module docstring for keys.

    ``trainer`` defaults to the module's attached trainer, and supplies the optimizers, LR
    schedulers, GradScaler (of its precision plugin) and logged metrics. The keyword
    arguments override what the trainer supplies, for runs outside Lightning.
    """
    trainer = trainer if trainer is not None else _attached_trainer(module)
    out = module_state(module)
    names = {id(p): name for name, p in module.named_parameters()}
    if optimizers is None:
        optimizers = trainer.optimizers if trainer is not None else ()
    out.update(optimizer_state(optimizers, names))
    if schedulers is None:
        configs = trainer.lr_scheduler_configs if trainer is not None else ()
        schedulers = [config.scheduler for config in configs]
    out.update(scheduler_state(schedulers))
    if scaler is None and trainer is not None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
    out.update(scaler_state(scaler))
    ema = getattr(module, "ema_state", None)
    if isinstance(ema, Mapping):
        for name, value in ema.items():
            _flatten(f"ema/{name}", value, out)
    if trainer is not None:
        out.update(_logged(trainer))
        out["progress/global_step"] = torch.tensor(trainer.global_step, dtype=torch.int64)
        out["progress/current_epoch"] = torch.tensor(trainer.current_epoch, dtype=torch.int64)
    return out


def _logged(trainer: L.Trainer) -> State:
    """``logged/<key>``: callback metrics, then any logger-only metric; a logger metric
    whose bits differ from the callback metric of one name goes to ``logged/logger/<key>``."""
    out: State = {}
    for key, value in trainer.callback_metrics.items():
        _flatten(f"logged/{key}", value, out)
    for key, value in trainer.logged_metrics.items():
        logged: State = {}
        _flatten(f"logged/{key}", value, logged)
        for name, tensor in logged.items():
            if name not in out:
                out[name] = tensor
            elif not bitwise_equal(out[name], tensor):
                out[name.replace("logged/", "logged/logger/", 1)] = tensor
    return out
