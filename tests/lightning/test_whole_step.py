"""The manual-optimization recipe: rk.TrainStep inside a LightningModule, bitwise equal to its twin."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replaykit as rk
from replaykit.errors import ReplayError
from replaykit.lightning import whole_step
from replaykit.testing.parity.step_trial import SmallNet, small_loss


class WholeStepModule(L.LightningModule):
    def __init__(self, replay: bool, accumulate: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SmallNet()
        self.replay, self.accumulate = replay, accumulate
        self.automatic_optimization = False
        self.losses: list[torch.Tensor] = []

    def configure_optimizers(self):
        opt = torch.optim.SGD(
            self.net.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True
        )
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}

    def on_train_start(self) -> None:
        loss_fn = lambda net, batch: small_loss(net, *batch)  # noqa: E731
        self.step = whole_step(
            self, self.net, loss_fn, max_norm=1.0, accumulate=self.accumulate, replay=self.replay
        )

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.losses.append(loss)
        self.log("train_loss", loss, prog_bar=False)
        if (batch_idx + 1) % self.accumulate == 0:
            self.lr_schedulers().step()


def _fit(replay: bool, accumulate: int) -> WholeStepModule:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
    module = WholeStepModule(replay, accumulate)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(2)
    trainer.fit(module, DataLoader(data, batch_size=6))
    module.global_step_seen = trainer.global_step
    return module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_whole_step_in_lightning_matches_its_twin_and_counts_steps(accumulate):
    twin, mine = _fit(False, accumulate), _fit(True, accumulate)
    assert mine.step.counts["replay"] > 0, mine.step.journal
    assert mine.global_step_seen == twin.global_step_seen == 8 // accumulate
    assert all(torch.equal(a, b) for a, b in zip(twin.losses, mine.losses, strict=True))
    for (name, a), b in zip(
        twin.net.state_dict().items(), mine.net.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_whole_step_needs_manual_optimization():
    module = WholeStepModule(True)
    module.automatic_optimization = True
    with pytest.raises(ReplayError, match="manual optimization"):
        whole_step(module, module.net, small_loss)


@pytest.mark.parametrize(
    "strategy, why",
    [
        ("FSDPStrategy", "not supported"),
        ("DDPStrategy", "its model is not a DistributedDataParallel around this LightningModule"),
    ],
)
def test_whole_step_under_another_strategy_is_refused_with_the_reason(strategy, why):
    """A strategy other than one device and DDP (whose wrapper around this module the step's
    reduction repeats: tests/lightning/test_whole_step_ddp.py) is refused, naming what works."""
    from types import SimpleNamespace

    module = WholeStepModule(True)
    module._trainer = SimpleNamespace(strategy=type(strategy, (), {"model": module.net})())
    with pytest.raises(
        ReplayError, match=rf"whole_step under {strategy}: {why}.*optimizer_step=True"
    ):
        whole_step(module, module.net, small_loss)


def test_whole_step_with_fabric_matches_its_twin():
    """Fabric: hand TrainStep the modules fabric.setup returns."""
    results = []
    for replay in (False, True):
        torch.manual_seed(0)
        fabric = L.Fabric(accelerator="cpu", devices=1)
        net = SmallNet()
        opt = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        net, opt = fabric.setup(net, opt)
        step = rk.TrainStep(net, small_loss, opt, max_norm=1.0, accumulate=2, replay=replay)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(2)
        losses = [
            step(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
            for _ in range(12)
        ]
        results.append((net, losses, step))
    (n0, l0, _), (n1, l1, step) = results
    assert step.counts["replay"] > 0
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(n0.state_dict().values(), n1.state_dict().values(), strict=True)
    )
