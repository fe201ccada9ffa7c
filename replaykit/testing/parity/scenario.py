"""The parity matrix's data model: a scenario, one arm's outcome, a scenario's result.

Both runners build on it: :mod:`replaykit.testing.parity.arms` (one process) and
:mod:`replaykit.testing.parity.ddp` (DDP under torchrun); neither imports the other's runner.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from replaykit.errors import ReplayWarning

from ...verify.bitwise import TensorDiff

PRECISIONS: tuple[str, ...] = ("32", "16-mixed", "bf16-mixed")
#: Which protection each probe (or accumulation) shows to matter.
EXERCISES = {"two_forwards": "hold", "keep_outputs": "live_outputs", "drop_head": "none_pattern"}


#: The automatic step arm's clipping by accumulation: norm and value alternate.
AUTOMATIC_CLIPS: dict[int, tuple[float, str]] = {
    1: (0.5, "norm"),
    2: (0.05, "value"),
    4: (1.0, "norm"),
}


def automatic_step_choice(
    precision: str, accumulation: int, optimizer: str = "auto"
) -> tuple[str, float | None, str]:
    """The automatic step arm's optimizer, clip value and clip algorithm for a scenario (the
    single-process matrix and the DDP matrix share it).

    ``optimizer="auto"``: plain SGD, except under ``16-mixed``, whose GradScaler replays with a
    fused optimizer only (a non-fused ``scaler.step`` reads ``found_inf`` on the host).
    Lightning's mixed precision does not let a fused optimizer clip (it unscales internally):
    such scenarios run unclipped.
    """
    clip, algorithm = AUTOMATIC_CLIPS.get(accumulation, (None, "norm"))
    if optimizer == "auto":
        optimizer = "sgd-fused" if precision == "16-mixed" else "sgd"
    if precision != "32" and optimizer.endswith("-fused"):
        clip = None
    return optimizer, clip, algorithm


@dataclass(frozen=True)
class Training:
    """What every parity matrix varies first: the task, its precision, accumulation and batches."""

    task: str = "detection"
    precision: str = "32"
    accumulation: int = 1
    layout: str = "contiguous"
    batch_size: int = 4


@dataclass(frozen=True)
class Scenario(Training):
    """One training configuration of the parity matrix."""

    n_train: int | None = None  # batches come from the layout when None
    max_steps: int = -1  # optimizer steps; -1: one epoch
    clip: float | None = None
    clip_algorithm: str = "norm"  # "norm" or "value"
    scheduler: str | None = None
    sched_interval: str = "step"  # "step" or "epoch"
    ema: float | None = None
    optimizer: str = "sgd"
    validate: bool = False
    probe: str | None = None
    overflow_step: int | None = None
    epochs: int = 1
    accumulation_schedule: tuple[tuple[int, int], ...] | None = None  # ((epoch, accumulation), ...)
    resume: bool = (
        False  # train ``epochs`` epochs, checkpoint, then resume for one more in a new Trainer
    )
    assign_at_step: int | None = None  # load_state_dict(..., assign=True) into net at this step
    seed: int = 0
    device: str = "cpu"
    devices: int = (
        1  # processes (DDP when > 1: launched by replaykit.testing.parity.ddp under torchrun)
    )
    one_device: bool = False  # DDP with every rank on one device over gloo (the one-GPU stand-in)
    check_every: int = (
        0  # the replay arm's shadow check: every N-th replayed call against eager (0: off)
    )

    @property
    def name(self) -> str:
        parts = [self.task, self.precision, f"acc{self.accumulation}", self.layout]
        flags = {
            "overflow": self.overflow_step is not None,
            "ema": self.ema is not None,
            "clip": self.clip is not None,
            "clip-value": self.clip is not None and self.clip_algorithm == "value",
            "epoch-sched": self.scheduler is not None and self.sched_interval == "epoch",
            "fused": self.optimizer.endswith("-fused"),
            "adamw": self.optimizer.startswith("adamw"),
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

    def step_exercised(self) -> tuple[str, ...]:
        """The optimizer step's protections whose absence this scenario can expose (the step arm's)."""
        fused = self.optimizer.endswith("-fused")
        if self.precision == "16-mixed" and not fused:
            return ()  # GradScaler.step with a non-fused optimizer: the step runs eagerly, with its reason
        out = ["grad_inputs"]  # every replayed step reads new gradients
        if self.scheduler is not None and not fused:
            out.append("host_values")  # a float lr the scheduler changes
        return tuple(out)


WARMUP_STEPS = 2  # the first steps record (replay) or warm caches (native): not steady-state timing


#: what every parity table's row leads with: the scenario, the arm and its verdict
VERDICT_COLUMNS = ("scenario", "arm", "expected", "equal", "ok", "tensors_differing")
#: the journal's summary beside a verdict: what recorded, replayed, ran eagerly (and why), retired
JOURNAL_SUMMARY = ("recordings", "replays", "eager", "eager_reasons", "backward_reasons", "retired")


def steady_steps(ms: list[float]) -> list[float]:
    """Per-step times without the warm-up steps, which record graphs and would swamp a median;
    kept whole when there are too few steps to spare them."""
    return ms[WARMUP_STEPS:] if len(ms) > 2 * WARMUP_STEPS else list(ms)


def journal_counts(rec: dict[str, Any]) -> dict[str, Any]:
    """A recorder summary's replays, eager calls and why, backward reasons and retirement: the
    journal columns of a row (:data:`JOURNAL_SUMMARY` but the recordings, which tables name apart)."""
    return {
        "replays": rec.get("replay", 0),
        "eager": rec.get("eager", 0),
        "eager_reasons": rec.get("eager_reasons", {}),
        "backward_reasons": rec.get("backward_reasons", {}),
        "retired": rec.get("retired"),
    }


def median_steady(ms: list[float]) -> float:
    """The median of :func:`steady_steps` (NaN for no steps): one step time for a table's row."""
    steady = steady_steps(ms)
    return statistics.median(steady) if steady else float("nan")


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
        if (
            arm.startswith("step-unsafe:")
            and arm.split(":", 1)[1] in self.scenario.step_exercised()
        ):
            return not self.equal(arm)
        return self.equal(arm)

    @property
    def passed(self) -> bool:
        return all(self.ok(arm) for arm in self.arms)


def quiet_replay_warnings() -> None:
    """Replay warnings are expected in unsafe arms; keep notebook output readable."""
    warnings.simplefilter("ignore", ReplayWarning)
