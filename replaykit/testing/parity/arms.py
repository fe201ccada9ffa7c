"""The Lightning parity harness: native vs replay arms of one scenario, compared bit for bit.

A scenario is a tiny task trained by a real ``Trainer`` (precision, accumulation,
clipping, schedulers, EMA, validation). Each arm trains it from the same seed: the
``native`` arm eagerly, the ``replay`` arm with :class:`ReplayCallback` on ``net``,
and ``unsafe:<protection>`` arms with one protection switched off. The end state
(weights, buffers, every optimizer step's gradients with their None pattern,
optimizer, GradScaler, scheduler and EMA state, logged metrics, outputs a probe
kept) of each arm is compared with native's.

Probes make a protection matter inside Lightning: ``two_forwards`` (the hold),
``keep_outputs`` (live outputs), ``drop_head`` (the None pattern); accumulation above
1 exercises copy-out; ``overflow_step`` makes an fp16 step overflow so GradScaler
skips it and backs off.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch

from replaykit.lightning import ReplayCallback
from replaykit.protections import PROTECTIONS, in_scope, negative_control

from ...verify.bitwise import diff_states
from ..tasks import make_datamodule, make_task
from .end_state import snapshot
from .scenario import PRECISIONS, ArmOutcome, Scenario, ScenarioResult


class GradTrace(L.Callback):
    """Every optimizer step's gradients (after unscaling), with their None pattern."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor | None] = {}
        self.steps = 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        for name, p in pl_module.named_parameters():
            self.grads[f"grad/step{self.steps}/{name}"] = (
                None if p.grad is None else p.grad.detach().cpu().clone()
            )
        self.steps += 1


class AssignAt(L.Callback):
    """``net.load_state_dict(same values, assign=True)`` before optimizer step ``step``: new Parameters."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.done = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        if not self.done and trainer.global_step == self.step:
            net = pl_module.net
            net.load_state_dict(
                {k: v.detach().clone() for k, v in net.state_dict().items()}, assign=True
            )
            self.done = True


class StepTimer(L.Callback):
    """Wall time of every training batch (synchronised on CUDA)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._t0 = 0.0

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        self._sync(pl_module)
        self.ms.append((time.perf_counter() - self._t0) * 1e3)


def _precision_args(precision: str, device: str) -> dict[str, Any]:
    """Trainer arguments for ``precision``; fp16 with a GradScaler on a CPU needs the plugin spelled out."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    if precision == "16-mixed" and device == "cpu":
        from lightning.pytorch.plugins import MixedPrecision

        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    return {"precision": precision}


def _trainer(
    scenario: Scenario, callbacks: list[L.Callback], epochs: int, **extra: Any
) -> L.Trainer:
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    layout: dict[str, Any] = {
        "devices": scenario.devices,
        "strategy": "ddp" if scenario.devices > 1 else "auto",
    }
    if scenario.one_device and scenario.devices > 1:
        from .one_device import one_device_trainer_args

        layout = one_device_trainer_args(scenario.devices)
    return L.Trainer(
        accelerator="gpu" if scenario.device.startswith("cuda") else "cpu",
        **layout,
        use_distributed_sampler=False,  # the datamodule shards its fixed batches by rank itself
        max_epochs=epochs,
        max_steps=scenario.max_steps,
        accumulate_grad_batches=scenario.accumulation,
        gradient_clip_val=scenario.clip,
        gradient_clip_algorithm=scenario.clip_algorithm,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=None if scenario.validate else 0,
        callbacks=callbacks,
        **_precision_args(scenario.precision, scenario.device),
        **extra,
    )


#: The arm that replays the automatic-optimization step too (network replay + the optimizer step).
STEP_ARM = "step"
#: Prefix of the step arm with one of the optimizer step's protections switched off.
STEP_UNSAFE = "step-unsafe:"


def _callback(scenario: Scenario, arm: str) -> ReplayCallback:
    """The replay callback an arm trains with."""
    if arm.startswith(STEP_UNSAFE):
        unsafe = negative_control(arm[len(STEP_UNSAFE) :])
        return ReplayCallback("net", optimizer_step={"unsafe_disable": unsafe})
    if arm == STEP_ARM:
        return ReplayCallback("net", check_every=scenario.check_every, optimizer_step=True)
    unsafe = negative_control(arm.split(":", 1)[1]) if arm.startswith("unsafe:") else ()
    return ReplayCallback(
        "net", unsafe_disable=unsafe, check_every=0 if unsafe else scenario.check_every
    )


def run_arm(scenario: Scenario, arm: str = "native") -> ArmOutcome:
    """Train ``scenario`` once: ``native``, ``replay``, ``step``, ``unsafe:<protection>`` or
    ``step-unsafe:<protection>`` (one of the optimizer step's)."""
    if (
        arm not in ("native", "replay", STEP_ARM)
        and not (arm.startswith("unsafe:") and arm[7:] in PROTECTIONS)
        and not (
            arm.startswith(STEP_UNSAFE) and arm[len(STEP_UNSAFE) :] in in_scope("optimizer_step")
        )
    ):
        raise ValueError(f"unknown arm {arm!r}")
    _precision_args(scenario.precision, scenario.device)  # bad input fails here, not inside fit
    L.seed_everything(scenario.seed, verbose=False)

    def new_task() -> L.LightningModule:
        return make_task(
            scenario.task,
            optimizer=scenario.optimizer,
            scheduler=scenario.scheduler,
            sched_interval=scenario.sched_interval,
            ema=scenario.ema,
            channels_last=scenario.layout == "channels_last",
            probe=scenario.probe,
            overflow_step=scenario.overflow_step,
        )

    task = new_task()
    data = make_datamodule(
        scenario.task,
        scenario.layout,
        batch_size=scenario.batch_size,
        seed=scenario.seed,
        n_train=scenario.n_train,
    )
    trace, timer = GradTrace(), StepTimer()
    callbacks: list[L.Callback] = [trace, timer]
    replay: ReplayCallback | None = None
    if arm != "native":
        replay = _callback(scenario, arm)
        callbacks.append(replay)
    if scenario.accumulation_schedule is not None:
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        callbacks.append(GradientAccumulationScheduler(dict(scenario.accumulation_schedule)))
    if scenario.assign_at_step is not None:
        callbacks.append(AssignAt(scenario.assign_at_step))
    start = time.perf_counter()
    error = None
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        try:
            if scenario.resume:
                from lightning.pytorch.callbacks import ModelCheckpoint

                ckpt = ModelCheckpoint(dirpath=tmp, save_last=True, save_top_k=0)
                _trainer(scenario, [*callbacks, ckpt], scenario.epochs).fit(task, datamodule=data)
                L.seed_everything(scenario.seed + 1, verbose=False)
                task = new_task()  # a new process would start from scratch and restore everything
                trainer = _trainer(
                    scenario, callbacks, scenario.epochs + 1, enable_checkpointing=False
                )
                trainer.fit(task, datamodule=data, ckpt_path=f"{tmp}/last.ckpt")
            else:
                trainer = _trainer(scenario, callbacks, scenario.epochs, enable_checkpointing=False)
                trainer.fit(task, datamodule=data)
        except Exception as exc:  # an arm that crashes is a failed arm, not a crashed matrix
            error = f"{type(exc).__name__}: {exc}"
            trainer = None
    seconds = time.perf_counter() - start
    state = {**snapshot(task, trainer), **trace.grads}
    for i, out in enumerate(task.kept_outputs):
        for k, v in out.items():
            state[f"kept/{i}/{k}"] = v.detach().cpu().clone()
    summary = None
    if replay is not None:
        summaries = replay.summary()
        summary = summaries.get("net")
        if "optimizer_step" in summaries and summary is not None:
            summary = {**summary, "optimizer_step": summaries["optimizer_step"]}
    return ArmOutcome(arm, state, summary, timer.ms, seconds, error)


def run_scenario(scenario: Scenario, arms: Iterable[str] = ("native", "replay")) -> ScenarioResult:
    """Every arm of ``scenario`` (``native`` always first), each compared with native."""
    names = ["native", *[a for a in arms if a != "native"]]
    outcomes = {name: run_arm(scenario, name) for name in names}
    native = outcomes["native"].state
    diffs = {name: diff_states(native, o.state) for name, o in outcomes.items() if name != "native"}
    return ScenarioResult(scenario, outcomes, diffs)


def unsafe_arms(scenario: Scenario) -> list[str]:
    """The unsafe arms whose protection the scenario exercises."""
    return [f"unsafe:{p}" for p in scenario.exercised()]


def step_unsafe_arms(scenario: Scenario) -> list[str]:
    """The step arm's unsafe arms whose protection the scenario exercises."""
    return [f"{STEP_UNSAFE}{p}" for p in scenario.step_exercised()]
