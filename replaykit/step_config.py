"""A whole step's settings, validated once and frozen: what its recordings bake in.

Changing the model, ``loss_fn``, optimizer, scaler, EMA, accumulation or precision under a
recording would replay the old one, so they are one frozen record checked together at
construction; ``step.accumulate = 4`` raises (:func:`fixed`). ``max_norm`` keys the recordings,
so ``step.max_norm`` may change.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .capturing import recorder_of
from .ema import EMA
from .errors import ReplayError, check_count
from .guards.compiled import refuse_cudagraphs
from .guards.distributed import IN_GRAPH_REFUSAL, ddp_refusal, is_ddp
from .memory.pool import MemoryPool, check_pool
from .protections import disabled_protections

#: ``precision`` -> the autocast dtype (None: no autocast)
PRECISIONS = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}

#: frames from :func:`disabled_protections` up to whoever called ``TrainStep(...)``
_TRAINSTEP_CALLER = 5


@dataclass(frozen=True, eq=False)
class StepConfig:
    """:class:`~replaykit.step.TrainStep`'s settings; see its docstring for each."""

    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    optimizer: torch.optim.Optimizer
    scaler: Any = None
    max_norm: float | None = None
    ema: EMA | None = None
    accumulate: int = 1
    precision: str = "32"
    replay: bool = True
    backend: str = "auto"
    warmup: int = 1
    max_recordings: int = 8
    max_rerecords: int = 8
    check_every: int = 0
    strict: bool = False
    trust_optimizer: bool = False
    #: validated (a warning per name) and kept as a frozenset
    unsafe_disable: frozenset[str] | tuple[str, ...] | list[str] | str = frozenset()
    on_optimizer_step: Callable[[], None] | None = None
    pool: MemoryPool | None = None
    #: the ranks that agree on each call's route (None: DDP's own group, when the model is DDP)
    process_group: Any = None
    #: seconds a replayed step's waits may take before ReplayError names the rank (None: off)
    replay_timeout: float | None = None
    #: NCCL's all-reduce captured in the backward graph: refused (not proven on two GPUs)
    collectives_in_graph: bool = False
    #: the DistributedDataParallel wrapper around ``model`` whose forward the caller runs around
    #: each call (Lightning's DDP strategy runs ``training_step`` inside it): the step repeats its
    #: reducer's all-reduce, and runs ``model``, not the wrapper
    ddp: nn.Module | None = None

    def __post_init__(self) -> None:
        self._check_objects()
        check_count("accumulate", self.accumulate, 1)
        check_count("warmup", self.warmup, 0)
        check_count("max_recordings", self.max_recordings, 1)
        check_count("max_rerecords", self.max_rerecords, 0)
        check_count("check_every", self.check_every, 0, "(0: off)")
        if self.ddp is not None:
            _check_outer_ddp(self.model, self.ddp)
        if self.collectives_in_graph:
            raise ReplayError(f"collectives_in_graph=True: {IN_GRAPH_REFUSAL}")
        if self.replay_timeout is not None and not float(self.replay_timeout) > 0:
            raise ReplayError(
                f"replay_timeout must be a positive number of seconds, not {self.replay_timeout!r}"
            )
        if self.precision not in PRECISIONS:
            raise ReplayError(f"precision {self.precision!r}: choose from {list(PRECISIONS)}")
        if recorder_of(self.model) is not None:
            raise ReplayError(
                "the model is captured by rk.capture already: a whole step records it itself"
            )
        if self.replay:
            refuse_cudagraphs(self.model, "TrainStep")
        disabled = disabled_protections(self.unsafe_disable, "step", _TRAINSTEP_CALLER)
        object.__setattr__(self, "unsafe_disable", disabled)
        object.__setattr__(self, "pool", check_pool(self.pool))
        for flag in ("replay", "strict", "trust_optimizer"):
            object.__setattr__(self, flag, bool(getattr(self, flag)))

    def _check_objects(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ReplayError(
                f"TrainStep takes an nn.Module as its model, not {type(self.model).__name__}"
            )
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ReplayError(
                f"TrainStep takes a torch.optim.Optimizer, not {type(self.optimizer).__name__}"
            )
        if isinstance(self.optimizer, torch.optim.LBFGS):
            raise ReplayError(
                "TrainStep steps the optimizer without a closure; LBFGS re-evaluates one (and reads the loss on the "
                "host): train LBFGS with its own closure loop"
            )
        if not callable(self.loss_fn):
            raise ReplayError(
                f"loss_fn must be callable as loss_fn(model, *batch), not {type(self.loss_fn).__name__}"
            )


def _check_outer_ddp(model: nn.Module, ddp: nn.Module) -> None:
    """``ddp=``: a DDP wrapper whose module holds every parameter of ``model`` (its reducer then
    reduces them); ``model`` itself is what runs, not a DDP wrapper. A DDP configuration the
    step's reduction does not repeat raises: the step's eager backward arms the default reducer
    (:func:`~replaykit.distributed.reduction.arm_reducer`), not what Lightning arranges for it."""
    if not is_ddp(ddp):
        raise ReplayError(
            f"ddp= takes the DistributedDataParallel wrapper, not {type(ddp).__name__}"
        )
    if is_ddp(model):
        raise ReplayError(
            "ddp= is for a model inside a DDP wrapper whose forward the caller runs; a DDP model "
            "is given alone: rk.TrainStep(ddp_model, ...)"
        )
    refused = ddp_refusal(ddp)
    if refused is not None:  # its eager arming is the default reducer's too: raise, not run eagerly
        raise ReplayError(f"ddp=: {refused}")
    inside = set(map(id, ddp.module.parameters()))
    if not all(id(p) in inside for p in model.parameters()):
        raise ReplayError(
            "ddp=: the model has parameters outside the DDP wrapper's module, which its reducer "
            "does not all-reduce"
        )


def fixed(name: str, path: str) -> property:
    """A read-only view of a setting (``path``, dotted, from the step): assigning it raises."""

    def refuse(step: Any, value: Any) -> None:
        raise ReplayError(
            f"TrainStep.{name} is fixed at construction (its recordings bake it in); build a new TrainStep instead"
        )

    return property(operator.attrgetter(path), refuse, doc=f"``{path}``, fixed at construction")
