"""The whole-step arm of the parity matrix: the four tasks trained by a :class:`~replaykit.step.TrainStep`
against its eager twin, per precision × accumulation × layout, plus an unsafe arm.

Each scenario trains one epoch of the task's synthetic data in a plain loop: fused SGD
with a tensor lr (StepLR after every optimizer step), ``clip_grad_norm_`` 1.0, an EMA
of the weights, GradScaler for 16-mixed. The replayed run must end bitwise equal to
the twin (weights, buffers, gradients and None pattern, optimizer, scaler, scheduler,
EMA, every loss). The unsafe arm switches ``module_state`` off and puts the first
BatchNorm in eval mode after the third optimizer step: the guard re-records, so
without it the frozen training-mode BatchNorm must diverge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...protections import negative_control
from ...step import EMA, TrainStep
from ...verify.bitwise import TensorDiff, diff_states
from ..tasks import make_datamodule, make_task
from .scenario import Training
from .step_trial import end_state


@dataclass(frozen=True)
class StepScenario(Training):
    steps: int = 7  # optimizer steps (a partial layout adds a half batch)
    device: str = "cpu"

    @property
    def name(self) -> str:
        return f"{self.task}/{self.precision}/acc{self.accumulation}/{self.layout}"


@dataclass
class StepScenarioResult:
    scenario: StepScenario
    diffs: list[TensorDiff]
    unsafe_diverged: bool
    journal: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.diffs and self.unsafe_diverged and self.journal.get("replay", 0) > 0


def _train(s: StepScenario, replay: bool, unsafe: bool) -> tuple[dict[str, Any], TrainStep]:
    torch.manual_seed(0)
    task = make_task(s.task, channels_last=s.layout == "channels_last")
    net = task.net.to(s.device)
    if s.layout == "channels_last":
        net = net.to(memory_format=torch.channels_last)
    layout = s.layout if s.layout != "channels_last" else "contiguous"
    n_train = s.batch_size * s.accumulation * s.steps + (
        s.batch_size // 2 if layout.startswith("partial") else 0
    )
    dm = make_datamodule(s.task, layout, batch_size=s.batch_size, seed=0, n_train=n_train)
    dm.setup("fit")
    opt = torch.optim.SGD(
        net.parameters(), lr=torch.tensor(0.02, device=s.device), momentum=0.9, fused=True
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    ema = EMA(net, 0.99)
    scaler = (
        torch.amp.GradScaler(s.device, init_scale=2.0**10) if s.precision == "16-mixed" else None
    )

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return task.loss(model(task.image(batch)), batch)[0]

    step = TrainStep(
        net,
        loss_fn,
        opt,
        scaler=scaler,
        max_norm=1.0,
        ema=ema,
        accumulate=s.accumulation,
        precision=s.precision,
        replay=replay,
        unsafe_disable=negative_control("module_state") if unsafe else (),
    )
    bn = next(m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    losses = []
    torch.manual_seed(1)
    for i, batch in enumerate(dm.train_dataloader()):
        batch = {k: v.to(s.device) for k, v in batch.items()}
        losses.append(step(batch))
        if (i + 1) % s.accumulation == 0:
            sched.step()
            if (i + 1) // s.accumulation == 3:
                bn.eval()  # guarded: records anew (the unsafe arm replays training-mode BN)
    return end_state(net, opt, scaler, sched, ema, losses), step


def run_scenario(s: StepScenario) -> StepScenarioResult:
    twin, _ = _train(s, replay=False, unsafe=False)
    mine, step = _train(s, replay=True, unsafe=False)
    bad, _ = _train(s, replay=True, unsafe=True)
    journal = {
        **step.counts,
        "eager_reasons": dict(step.eager_reasons),
        "retired": step.retire_reason,
    }
    return StepScenarioResult(s, diff_states(twin, mine), bool(diff_states(twin, bad)), journal)


def matrix(tasks, precisions, accumulations, layouts, device: str = "cpu") -> list[StepScenario]:
    return [
        StepScenario(t, p, a, layout, device=device)
        for t in tasks
        for p in precisions
        for a in accumulations
        for layout in layouts
    ]


def rows(results: list[StepScenarioResult]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        first = r.diffs[0] if r.diffs else None
        out.append(
            {
                "scenario": r.scenario.name,
                "bitwise": not r.diffs,
                "unsafe_diverged": r.unsafe_diverged,
                "replays": r.journal.get("replay", 0),
                "records": r.journal.get("record", 0),
                "eager": r.journal.get("eager_reasons"),
                "retired": r.journal.get("retired"),
                "first_diff": None if first is None else f"{first.name}: {first.problem}",
            }
        )
    return out


def summary(results: list[StepScenarioResult]) -> dict[str, Any]:
    n = len(results)
    bitwise = sum(not r.diffs for r in results)
    diverged = sum(r.unsafe_diverged for r in results)
    passed = sum(r.passed for r in results)
    line = f"whole step: {passed}/{n} scenarios passed; replay {bitwise}/{n} bitwise equal to the eager twin; unsafe arms {diverged}/{n} diverged"
    return {
        "line": line,
        "passed": passed,
        "total": n,
        "bitwise": bitwise,
        "unsafe_diverged": diverged,
    }
