"""ReplayCallback inside real Trainer.fit: lifecycle, and parity for what Lightning adds around the net."""

from __future__ import annotations

import gc
import weakref

import lightning as L
import pytest
import torch

import replaykit as rk
from replaykit.lightning import ReplayCallback
from replaykit.testing.parity.arms import run_scenario, unsafe_arms
from replaykit.testing.parity.scenario import Scenario
from replaykit.testing.tasks import make_task

from ._fit import fit_detection
from ._fit import trainer as quiet_trainer


def _fit(cb: ReplayCallback, task=None, **kw) -> tuple[L.LightningModule, L.Trainer]:
    task = task or make_task("detection")
    return task, fit_detection(task, callbacks=[cb], **kw)


def test_activates_once_per_fit_cleans_up_and_fits_again() -> None:
    cb = ReplayCallback("net")
    task, _ = _fit(cb, limit_val_batches=0)
    first = cb.recorders["net"]
    assert cb.fits == 1 and first.counts["record"] == 1 and first.counts["replay"] == 5
    assert "forward" not in task.net.__dict__ and rk.recorder_of(task.net) is None
    assert first.released and first.module is None
    _fit(cb, task, limit_val_batches=0)
    assert (
        cb.fits == 2
        and cb.recorders["net"] is not first
        and cb.recorders["net"].counts["replay"] == 5
    )


def test_summary_after_fit_gives_each_recorders_counts_and_the_optimizer_step() -> None:
    cb = ReplayCallback("net", optimizer_step=True)
    _fit(cb, limit_val_batches=0)
    said = cb.summary()  # after the fit: the recorders are released, their counts stay
    assert set(said) == {"net", "optimizer_step"}
    net = said["net"]
    assert (net["record"], net["replay"], net["retired"]) == (1, 5, None), net
    assert said["optimizer_step"]["replay"] >= 1 and said["optimizer_step"]["retired"] is None


def test_no_reference_cycles_after_fit() -> None:
    cb = ReplayCallback("net")
    _fit(cb, limit_val_batches=0)
    gc.collect()
    gc.disable()
    try:
        refs = [weakref.ref(r) for r in cb.recorders.values()]
        cb.recorders.clear()
        assert all(r() is None for r in refs)  # freed by reference counting alone: no cycles
    finally:
        gc.enable()


def test_validation_routes_eager_with_reason() -> None:
    cb = ReplayCallback("net")
    _fit(cb)
    assert (
        cb.recorders["net"].eager_reasons["no_grad"] >= 1
    )  # Lightning validates without grad, in eval mode


def test_bad_paths() -> None:
    with pytest.raises(rk.ReplayError, match="attribute path"):
        ReplayCallback()
    with pytest.raises(rk.ReplayError, match="no attribute path"):
        _fit(ReplayCallback("nope"), limit_val_batches=0)


class _Heads(L.LightningModule):
    """Its network is a ModuleDict: the training step calls the children, never the dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.ModuleDict(
            {"body": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 2)}
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net["head"](self.net["body"](batch[0])).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_dict_whose_forward_is_never_called_is_refused_naming_its_children() -> None:
    """Captured, it would record nothing and say nothing; its children are what runs."""
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4
    )
    trainer = quiet_trainer(callbacks=[ReplayCallback("net")])
    with pytest.raises(
        rk.ReplayError, match=r"ModuleDict without a forward.*'net.body', 'net.head'"
    ):
        trainer.fit(_Heads(), data)
    cb = ReplayCallback("net.body", "net.head")
    trainer = quiet_trainer(callbacks=[cb])
    trainer.fit(_Heads(), data)
    assert cb.recorders["net.head"].counts["record"] == 1


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(accumulation=2, clip=0.5, scheduler="cosine", ema=0.9),
        Scenario(task="oriented", precision="16-mixed", accumulation=2, overflow_step=1),
        Scenario(task="pose", precision="bf16-mixed", accumulation=3, layout="partial_between"),
        Scenario(task="segmentation", accumulation=2, validate=True, ema=0.9),
        Scenario(accumulation=1, epochs=2, accumulation_schedule=((0, 1), (1, 2))),
        Scenario(task="pose", accumulation=2, resume=True, ema=0.9, scheduler="step"),
        Scenario(accumulation=2, assign_at_step=1),
    ],
    ids=lambda s: s.name,
)
def test_lightning_features_keep_parity(scenario: Scenario) -> None:
    result = run_scenario(scenario, ["replay", *unsafe_arms(scenario)])
    assert result.passed, {a: [d.name for d in ds][:5] for a, ds in result.diffs.items()}
    replay = result.arms["replay"].recorder
    assert replay["replay"] >= 2 or scenario.assign_at_step is not None
    if scenario.assign_at_step is not None:
        assert (
            not replay["retired"] and "registered anew" in replay["rerecord_causes"][0]
        )  # resumed replaying
    if scenario.overflow_step is not None:
        native = result.arms["native"].state
        assert float(native["scaler/scale"]) < 65536.0  # the overflow step backed the scale off
    if scenario.ema is not None:
        assert any(k.startswith("ema/") for k in result.arms["native"].state)


def test_fp16_overflow_step_is_skipped_like_native() -> None:
    result = run_scenario(Scenario(precision="16-mixed", overflow_step=2), ["replay"])
    assert result.passed
    state = result.arms["replay"].state
    assert "scaler/_growth_tracker" in state and torch.equal(
        state["scaler/scale"], result.arms["native"].state["scaler/scale"]
    )


def test_bf16_on_a_gpu_without_it_retires_instead_of_crashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    from replaykit.lightning import unsupported

    strategy = SingleDeviceStrategy.__new__(SingleDeviceStrategy)
    monkeypatch.setattr(
        SingleDeviceStrategy, "root_device", property(lambda self: torch.device("cuda", 0))
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    reason = unsupported(SimpleNamespace(strategy=strategy, precision="bf16-mixed"))
    assert reason is not None and "no bf16 support" in reason
    assert unsupported(SimpleNamespace(strategy=strategy, precision="16-mixed")) is None


def test_accumulation_changed_between_fits_keeps_replay_and_parity() -> None:
    from replaykit.testing.parity.end_state import snapshot
    from replaykit.verify.bitwise import diff_states

    def two_fits(replay: bool) -> tuple[dict, ReplayCallback | None]:
        L.seed_everything(0, verbose=False)
        task = make_task("detection")
        cb = ReplayCallback("net") if replay else None
        for acc in (1, 2):
            trainer = fit_detection(
                task,
                accumulate_grad_batches=acc,
                limit_val_batches=0,
                deterministic=True,
                callbacks=[cb] if cb else [],
            )
        return snapshot(task, trainer), cb

    native, _ = two_fits(False)
    replayed, cb = two_fits(True)
    assert diff_states(native, replayed) == []
    assert cb.fits == 2 and cb.recorders["net"].counts["replay"] == 5
