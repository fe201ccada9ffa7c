"""ReplayCallback(optimizer_step=True): the automatic-optimization step replayed, bitwise equal to native."""

from __future__ import annotations

import lightning as L
import pytest

from replaykit.lightning import ReplayCallback
from replaykit.testing.parity.arms import run_scenario, step_unsafe_arms
from replaykit.testing.parity.scenario import Scenario
from replaykit.testing.tasks import make_datamodule, make_task

from ._fit import fit_detection
from ._fit import trainer as quiet_trainer


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(accumulation=2, layout="channels_last", clip=0.5),
        Scenario(
            task="pose", precision="bf16-mixed", accumulation=4, batch_size=2, n_train=24, clip=1.0
        ),
        Scenario(
            task="oriented",
            clip=0.05,
            clip_algorithm="value",
            scheduler="cosine",
            sched_interval="epoch",
            epochs=2,
            n_train=16,
        ),
        Scenario(
            task="segmentation",
            precision="16-mixed",
            optimizer="sgd-fused",
            accumulation=2,
            overflow_step=1,
            scheduler="cosine",
            ema=0.9,
        ),
    ],
    ids=lambda s: f"{s.name}/{s.optimizer}",
)
def test_automatic_step_keeps_parity_and_unsafe_arms_diverge(scenario: Scenario) -> None:
    arms = ["step", *step_unsafe_arms(scenario)]
    result = run_scenario(scenario, arms)
    assert result.passed, {a: [d.name for d in ds][:5] for a, ds in result.diffs.items()}
    assert len(arms) >= 2  # each scenario shows a protection is needed
    summary = result.arms["step"].recorder
    assert summary["replay"] >= 1  # network replay
    assert summary["optimizer_step"]["replay"] >= 1, summary["optimizer_step"]


def test_a_checkpoint_written_under_it_resumes_and_keeps_replaying() -> None:
    scenario = Scenario(task="pose", accumulation=2, resume=True, optimizer="sgd-fused", clip=1.0)
    result = run_scenario(scenario, ["step"])
    assert result.passed, result.diffs
    resumed = result.arms["step"].recorder["optimizer_step"]  # the last (resumed) fit's
    assert resumed["replay"] >= 1 and resumed["eager_reasons"] == {"warmup": 1}


def test_fp16_with_a_non_fused_optimizer_runs_lightnings_step_with_the_reason() -> None:
    result = run_scenario(Scenario(precision="16-mixed", accumulation=2), ["step"])
    assert result.passed, result.diffs
    reasons = result.arms["step"].recorder["optimizer_step"]["eager_reasons"]
    assert any("non-fused SGD reads found_inf on the host" in r for r in reasons), reasons


def _fit(task: L.LightningModule, cb: ReplayCallback, **kw) -> L.Trainer:
    return fit_detection(task, limit_val_batches=0, callbacks=[cb], **kw)


_SHORT = {"limit_train_batches": 4}


def test_the_trainer_gets_its_precision_plugin_back_and_the_checkpoint_key_is_native() -> None:
    cb = ReplayCallback("net", optimizer_step=True)
    seen = {}

    class Peek(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            plugin = trainer.precision_plugin
            seen["qualname"] = type(plugin).__qualname__
            seen["native"] = isinstance(plugin, type(cb._native_precision))

    task = make_task("detection")
    trainer = quiet_trainer(
        limit_val_batches=0, limit_train_batches=4, callbacks=[cb, Peek()], precision="bf16-mixed"
    )
    native = trainer.precision_plugin
    trainer.fit(task, datamodule=make_datamodule("detection"))
    assert trainer.precision_plugin is native  # restored after the fit
    assert seen == {"qualname": type(native).__qualname__, "native": True}
    assert cb.optimizer_step is not None and cb.optimizer_step.released
    assert cb.optimizer_step.counts["replay"] == 2


def test_overridden_clipping_and_manual_optimization_run_natively_with_reasons() -> None:
    class OwnClip(type(make_task("detection"))):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **kw) -> None:
            if self.global_step > 2:  # Python a graph would freeze
                self.clip_gradients(optimizer, gradient_clip_val=0.1)

    cb = ReplayCallback("net", optimizer_step=True)
    _fit(OwnClip(), cb, **_SHORT)
    assert cb.optimizer_step.counts["replay"] == 0
    assert "configure_gradient_clipping is overridden" in next(
        iter(cb.optimizer_step.eager_reasons)
    )
    assert cb.recorders["net"].counts["replay"] == 3  # network replay goes on

    class Manual(type(make_task("detection"))):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            opt.step()

    cb = ReplayCallback("net", optimizer_step=True)
    _fit(Manual(), cb, **_SHORT)
    assert cb.optimizer_step is None and "manual optimization" in cb.optimizer_step_refusal
    assert cb.summary()["optimizer_step"] == {"refused": cb.optimizer_step_refusal}
