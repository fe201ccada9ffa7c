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

import itertools
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch

from .bitwise import TensorDiff, diff_states
from .errors import ReplayWarning
from .lightning import ReplayCallback
from .protections import PROTECTIONS
from .snapshot import snapshot
from .tasks import make_datamodule, make_task

PRECISIONS: tuple[str, ...] = ("32", "16-mixed", "bf16-mixed")
#: Which protection each probe (or accumulation) shows to matter.
EXERCISES = {"two_forwards": "hold", "keep_outputs": "live_outputs", "drop_head": "none_pattern"}


@dataclass(frozen=True)
class Scenario:
    """One training configuration of the parity matrix."""

    task: str = "detection"
    precision: str = "32"
    accumulation: int = 1
    layout: str = "contiguous"
    batch_size: int = 4
    n_train: int | None = None  # batches come from the layout when None
    max_steps: int = -1  # optimizer steps; -1: one epoch
    clip: float | None = None
    scheduler: str | None = None
    ema: float | None = None
    optimizer: str = "sgd"
    validate: bool = False
    probe: str | None = None
    overflow_step: int | None = None
    epochs: int = 1
    accumulation_schedule: tuple[tuple[int, int], ...] | None = None  # ((epoch, accumulation), ...)
    resume: bool = False  # train ``epochs`` epochs, checkpoint, then resume for one more in a new Trainer
    assign_at_step: int | None = None  # load_state_dict(..., assign=True) into net at this step
    seed: int = 0
    device: str = "cpu"
    devices: int = 1  # processes (DDP when > 1: launched by replaykit.ddp_parity under torchrun)

    @property
    def name(self) -> str:
        parts = [self.task, self.precision, f"acc{self.accumulation}", self.layout]
        flags = {
            "overflow": self.overflow_step is not None,
            "ema": self.ema is not None,
            "clip": self.clip is not None,
            "sched": self.scheduler is not None,
            "val": self.validate,
            "acc-schedule": self.accumulation_schedule is not None,
            "resume": self.resume,
            "assign": self.assign_at_step is not None,
        }
        parts += [p for p in (self.probe, *(k for k, on in flags.items() if on)) if p]
        return "/".join(str(p) for p in parts)

    def exercised(self) -> tuple[str, ...]:
        """Protections whose absence this scenario can expose."""
        # with drop_head (a partial backward: fresh gradients) or two_forwards (eager and replay
        # gradients summed before AccumulateGrad) no static buffer becomes a .grad
        aliasing = self.probe not in ("drop_head", "two_forwards")
        out = ["copy_out"] if self.accumulation > 1 and aliasing else []
        if self.probe in EXERCISES:
            out.append(EXERCISES[self.probe])
        return tuple(out)


@dataclass
class ArmOutcome:
    """What one arm ended with."""

    arm: str
    state: dict[str, torch.Tensor | None]
    recorder: dict[str, Any] | None
    step_ms: list[float]
    seconds: float
    error: str | None = None


@dataclass
class ScenarioResult:
    """Both (or more) arms of one scenario and how each compares with native."""

    scenario: Scenario
    arms: dict[str, ArmOutcome]
    diffs: dict[str, list[TensorDiff]] = field(default_factory=dict)

    def equal(self, arm: str) -> bool:
        return self.arms[arm].error is None and not self.diffs.get(arm)

    def ok(self, arm: str) -> bool:
        """Replay arms must equal native; an unsafe arm must diverge where its protection is exercised."""
        if arm == "native":
            return self.arms[arm].error is None
        if arm.startswith("unsafe:") and arm.split(":", 1)[1] in self.scenario.exercised():
            return not self.equal(arm)
        return self.equal(arm)

    @property
    def passed(self) -> bool:
        return all(self.ok(arm) for arm in self.arms)


class GradTrace(L.Callback):
    """Every optimizer step's gradients (after unscaling), with their None pattern."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor | None] = {}
        self.steps = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        for name, p in pl_module.named_parameters():
            self.grads[f"grad/step{self.steps}/{name}"] = None if p.grad is None else p.grad.detach().cpu().clone()
        self.steps += 1


class AssignAt(L.Callback):
    """``net.load_state_dict(same values, assign=True)`` before optimizer step ``step``: new Parameters."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.done = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.done and trainer.global_step == self.step:
            net = pl_module.net
            net.load_state_dict({k: v.detach().clone() for k, v in net.state_dict().items()}, assign=True)
            self.done = True


class StepTimer(L.Callback):
    """Wall time of every training batch (synchronised on CUDA)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._t0 = 0.0

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
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


def _trainer(scenario: Scenario, callbacks: list[L.Callback], epochs: int, **extra: Any) -> L.Trainer:
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return L.Trainer(
        accelerator="gpu" if scenario.device.startswith("cuda") else "cpu",
        devices=scenario.devices,
        strategy="ddp" if scenario.devices > 1 else "auto",
        use_distributed_sampler=False,  # the datamodule shards its fixed batches by rank itself
        max_epochs=epochs,
        max_steps=scenario.max_steps,
        accumulate_grad_batches=scenario.accumulation,
        gradient_clip_val=scenario.clip,
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


def run_arm(scenario: Scenario, arm: str = "native") -> ArmOutcome:
    """Train ``scenario`` once: ``native``, ``replay`` or ``unsafe:<protection>``."""
    if arm != "native" and arm != "replay" and not (arm.startswith("unsafe:") and arm[7:] in PROTECTIONS):
        raise ValueError(f"unknown arm {arm!r}")
    _precision_args(scenario.precision, scenario.device)  # bad input fails here, not inside fit
    L.seed_everything(scenario.seed, verbose=False)

    def new_task() -> L.LightningModule:
        return make_task(
            scenario.task,
            optimizer=scenario.optimizer,
            scheduler=scenario.scheduler,
            ema=scenario.ema,
            channels_last=scenario.layout == "channels_last",
            probe=scenario.probe,
            overflow_step=scenario.overflow_step,
        )

    task = new_task()
    data = make_datamodule(
        scenario.task, scenario.layout, batch_size=scenario.batch_size, seed=scenario.seed, n_train=scenario.n_train
    )
    trace, timer = GradTrace(), StepTimer()
    callbacks: list[L.Callback] = [trace, timer]
    replay: ReplayCallback | None = None
    if arm != "native":
        unsafe = (arm.split(":", 1)[1],) if arm.startswith("unsafe:") else ()
        replay = ReplayCallback("net", unsafe_disable=unsafe)
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
                trainer = _trainer(scenario, callbacks, scenario.epochs + 1, enable_checkpointing=False)
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
    summary = replay.summary().get("net") if replay is not None else None
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


def matrix(
    tasks: Iterable[str] = ("detection", "pose", "oriented", "segmentation"),
    precisions: Iterable[str] = PRECISIONS,
    accumulations: Iterable[int] = (1, 2, 3),
    layouts: Iterable[str] = ("contiguous", "channels_last"),
    partial_layouts: Iterable[str] = ("partial_last", "partial_between"),
    partial_accumulation: int = 2,
    **common: Any,
) -> list[Scenario]:
    """task x precision x accumulation x layout, plus the partial-batch layouts at one accumulation."""
    tasks, precisions = list(tasks), list(precisions)
    out = [
        Scenario(task=t, precision=p, accumulation=a, layout=lay, **common)
        for t, p, a, lay in itertools.product(tasks, precisions, accumulations, layouts)
    ]
    out += [
        Scenario(task=t, precision=p, accumulation=partial_accumulation, layout=lay, **common)
        for t, p, lay in itertools.product(tasks, precisions, partial_layouts)
    ]
    return out


def run_matrix(
    scenarios: Iterable[Scenario], with_unsafe: bool = False, progress: bool = True
) -> Iterator[ScenarioResult]:
    """Run scenarios one by one (a tqdm bar when ``progress``), yielding each result as it comes."""
    scenarios = list(scenarios)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(scenarios), desc="parity", unit="case")
    try:
        for scenario in scenarios:
            arms = ["replay", *(unsafe_arms(scenario) if with_unsafe else [])]
            if scenario.devices > 1:  # each arm as DDP processes under torchrun
                from .ddp_parity import run_scenario as run_ddp

                result = run_ddp(scenario, ("native", *arms))
            else:
                result = run_scenario(scenario, arms)
            if bar is not None:
                bar.set_postfix_str(f"{scenario.name}: {'pass' if result.passed else 'FAIL'}")
                bar.update()
            yield result
    finally:
        if bar is not None:
            bar.close()


def diff_rows(results: Iterable[ScenarioResult], limit: int = 20) -> list[dict[str, Any]]:
    """The diff table: per scenario and non-native arm, one row per tensor that differs
    (name, problem, max abs diff, max ULP distance, mismatched elements), ``limit`` rows at most each."""
    out = []
    for r in results:
        for arm, diffs in r.diffs.items():
            out += [{"scenario": r.scenario.name, "arm": arm, **d.as_dict()} for d in diffs[:limit]]
    return out


def summary(results: Iterable[ScenarioResult]) -> dict[str, Any]:
    """Counts for a run's summary.json, and the one line an engineering log quotes."""
    results = list(results)
    table = rows(results)
    replay = [r for r in table if r["arm"] == "replay"]
    unsafe = [r for r in table if r["arm"] != "replay"]
    diverged = [r for r in unsafe if not r["equal"]]
    line = (
        f"{sum(r.passed for r in results)}/{len(results)} scenarios passed; replay arm: "
        f"{sum(r['equal'] for r in replay)}/{len(replay)} bitwise equal; unsafe arms: "
        f"{len(diverged)}/{len(unsafe)} diverged"
    )
    return {
        "line": line,
        "scenarios": len(results),
        "passed": sum(r.passed for r in results),
        "failed": [r.scenario.name for r in results if not r.passed],
        "replay_equal": sum(r["equal"] for r in replay),
        "replay_cases": len(replay),
        "unsafe_diverged": len(diverged),
        "unsafe_cases": len(unsafe),
    }


def _median_steady(ms: list[float]) -> float:
    steady = ms[2:] if len(ms) > 4 else ms
    return statistics.median(steady) if steady else float("nan")


def rows(results: Iterable[ScenarioResult]) -> list[dict[str, Any]]:
    """One row per scenario and non-native arm: pass/fail, diff summary, journal summary, step times."""
    out = []
    for r in results:
        native = r.arms["native"]
        for name, arm in r.arms.items():
            if name == "native":
                continue
            diffs = r.diffs.get(name, [])
            rec = arm.recorder or {}
            out.append(
                {
                    **{k: v for k, v in asdict(r.scenario).items() if k not in ("device",)},
                    "scenario": r.scenario.name,
                    "arm": name,
                    "expected": "diverge" if name.startswith("unsafe:") and name[7:] in r.scenario.exercised() else "equal",
                    "equal": r.equal(name),
                    "ok": r.ok(name),
                    "tensors_differing": len(diffs),
                    "max_abs_diff": max((d.max_abs for d in diffs if d.problem == "values"), default=0.0),
                    "none_pattern_diffs": sum(d.problem == "none_pattern" for d in diffs),
                    "recordings": rec.get("record", 0),
                    "replays": rec.get("replay", 0),
                    "eager": rec.get("eager", 0),
                    "eager_reasons": rec.get("eager_reasons", {}),
                    "backward_reasons": rec.get("backward_reasons", {}),
                    "retired": rec.get("retired"),
                    "native_step_ms": _median_steady(native.step_ms),
                    "arm_step_ms": _median_steady(arm.step_ms),
                    "error": arm.error or native.error,
                }
            )
    return out


def frame(results: Iterable[ScenarioResult]):
    """The rows as a pandas DataFrame (what the notebooks render)."""
    import pandas as pd

    return pd.DataFrame(rows(results))


def quiet_replay_warnings() -> None:
    """Replay warnings are expected in unsafe arms; keep notebook output readable."""
    warnings.simplefilter("ignore", ReplayWarning)
