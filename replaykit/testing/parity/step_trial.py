"""Whole-step trials: the same plain-PyTorch training run as a :class:`~replaykit.step.TrainStep`
and as its eager twin, compared bit for bit (parameters, buffers, gradients and their None
pattern, optimizer, scaler, scheduler and EMA state, every returned loss).

>>> result = trial(StepConfig(optimizer="adamw", accumulate=2, clip=1.0, ema=0.9))
>>> result.equal, result.step.counts
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ...protections import negative_control
from ...step import EMA, TrainStep
from ...verify.bitwise import TensorDiff, diff_states
from .end_state import module_state, optimizer_state, scaler_state, scheduler_state


class SmallNet(nn.Module):
    """BatchNorm statistics, dropout's RNG and a shared head: what a step must replay exactly."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1)
        )
        self.head = nn.Linear(width, classes)
        self.p = 0.1  # a host value the loss reads (see ``probe="anneal_attr"``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * (1 + self.p)


def small_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


@dataclass(frozen=True)
class StepConfig:
    """One whole-step run."""

    optimizer: str = (
        "sgd"  # sgd (fused, tensor lr) | sgd_float (foreach, float lr) | adamw (fused) | adam_plain
    )
    accumulate: int = 1
    clip: float | None = None
    ema: float | None = None
    scheduler: bool = False  # StepLR(step_size=2, gamma=0.5) after every optimizer step
    precision: str = "32"
    scaler: bool = False
    steps: int = 6  # optimizer steps
    partial_last: bool = True  # the last micro-batch is smaller (its own recording, or eager)
    overflow_step: int | None = (
        None  # that optimizer step's first micro-batch holds an inf: the scaler skips
    )
    probe: str | None = None  # a user action between steps (see ``PROBES``)
    unsafe: tuple[str, ...] = ()
    device: str = "cpu"
    backend: str = "auto"
    seed: int = 0


@dataclass
class StepResult:
    config: StepConfig
    diffs: list[TensorDiff]
    step: TrainStep
    twin: TrainStep
    losses: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.diffs


def make_optimizer(name: str, model: nn.Module, device: str) -> torch.optim.Optimizer:
    """The trials' optimizers by name: ``sgd`` (fused, tensor lr), ``sgd_float``, ``adamw`` (fused), ``adam_plain``."""
    params = model.parameters()
    lr = torch.tensor(0.05, device=device)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True
        )
    if name == "sgd_float":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        # capturable on CUDA: step() refuses a capture without it, fused or not
        cuda = device.startswith("cuda")
        return torch.optim.AdamW(
            params,
            lr=torch.tensor(1e-2, device=device),
            weight_decay=1e-2,
            fused=True,
            capturable=cuda,
        )
    if (
        name == "adam_plain"
    ):  # capturable=False: refused on CUDA with a reason, replayed on the CPU tape
        return torch.optim.Adam(params, lr=1e-2)
    raise ValueError(f"unknown optimizer {name!r}")


def _grad_keeper(model: nn.Module) -> Callable[[int, int], None]:
    kept: list[torch.Tensor] = []

    def keep(
        step: int, micro: int
    ) -> None:  # a gradient kept after a micro-batch (logging its norm later)
        if micro == 0 and model.head.weight.grad is not None:
            kept.append(model.head.weight.grad)

    keep.kept = kept  # type: ignore[attr-defined]
    return keep


#: User actions between optimizer steps, each guarded (the guard's unsafe arm diverges).
PROBES: dict[str, str] = {
    "anneal_attr": "module_state",  # a float attribute the forward reads, annealed
    "float_lr": "host_values",  # a float lr changed by hand
    "load_state": "state_identity",  # optimizer.load_state_dict (state tensors replaced)
    "new_param": "param_identity",  # a parameter replaced by a new nn.Parameter
    "keep_grad": "copy_out",  # a gradient kept between micro-batches, read after later steps
}


def run(config: StepConfig, replay: bool) -> tuple[dict[str, Any], TrainStep, list[torch.Tensor]]:
    """Train ``config.steps`` optimizer steps; returns the end state, the step and the losses."""
    torch.manual_seed(config.seed)
    model = SmallNet().to(config.device)
    opt = make_optimizer(config.optimizer, model, config.device)
    ema = EMA(model, config.ema) if config.ema is not None else None
    sched = (
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if config.scheduler else None
    )
    scaler = (
        torch.amp.GradScaler(config.device, init_scale=2.0**8, growth_interval=2)
        if config.scaler
        else None
    )
    unsafe = negative_control(*config.unsafe) if replay and config.unsafe else ()
    step = TrainStep(
        model,
        small_loss,
        opt,
        scaler=scaler,
        max_norm=config.clip,
        ema=ema,
        accumulate=config.accumulate,
        precision=config.precision,
        replay=replay,
        backend=config.backend,
        unsafe_disable=unsafe,
    )
    g = torch.Generator().manual_seed(config.seed + 1)
    keeper = _grad_keeper(model)
    losses = []
    torch.manual_seed(config.seed + 2)  # dropout
    total = config.steps * config.accumulate
    for i in range(total):
        s, micro = divmod(i, config.accumulate)
        n = 5 if config.partial_last and i == total - 1 else 6
        x = torch.randn(n, 8, generator=g)
        if config.overflow_step == s and micro == 0:
            x[0, 0] = float("inf")
        y = torch.randint(0, 4, (n,), generator=g)
        losses.append(step(x.to(config.device), y.to(config.device)))
        if config.probe == "keep_grad":
            keeper(s, micro)
        if micro == config.accumulate - 1:
            _probe(config.probe, s, model, opt)
            if sched is not None:
                sched.step()
    state = end_state(model, opt, scaler, sched, ema, losses, kept=keeper.kept)  # type: ignore[attr-defined]
    return state, step, losses


def end_state(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    sched: Any,
    ema: EMA | None,
    losses: list[torch.Tensor],
    kept: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Everything a whole-step run must end with bitwise: model, optimizer, scaler, scheduler, EMA,
    what the user kept, every loss (the trials and :mod:`replaykit.testing.parity.step_matrix` compare it)."""
    state = module_state(model)
    state.update(optimizer_state([opt]))
    state.update(scaler_state(scaler))
    if sched is not None:
        state.update(scheduler_state([sched]))
    if ema is not None:
        state.update({f"ema/{i}": t.detach().cpu() for i, t in enumerate(ema.params)})
    state.update({f"kept/{i}": t.detach().cpu() for i, t in enumerate(kept)})
    state.update({f"loss/{i}": t.detach().cpu() for i, t in enumerate(losses)})
    return state


def _probe(probe: str | None, s: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    if probe == "anneal_attr":
        model.p = 0.1 * (s + 2)
    elif probe == "float_lr" and s == 2:
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.5 if not isinstance(g["lr"], torch.Tensor) else g["lr"]
    elif probe == "load_state" and s == 2:
        opt.load_state_dict(
            copy.deepcopy(opt.state_dict())
        )  # a checkpoint resumed: same values, new tensors
    elif probe == "new_param" and s == 2:
        model.head.bias = nn.Parameter(model.head.bias.detach().clone())
        opt.param_groups[0]["params"][-1] = model.head.bias  # the user keeps the optimizer in step
        opt.state[model.head.bias] = opt.state.pop(
            next(
                p
                for p in opt.state
                if p.shape == model.head.bias.shape and p is not model.head.bias
            ),
            {},
        )


def trial(config: StepConfig) -> StepResult:
    """The replayed run against its eager twin."""
    ref, twin, _ = run(replace(config, unsafe=()), replay=False)
    other, step, losses = run(config, replay=True)
    return StepResult(config, diff_states(ref, other), step, twin, len(losses))
