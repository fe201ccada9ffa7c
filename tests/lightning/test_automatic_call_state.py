"""Lightning's automatic step under ``ReplayCallback(optimizer_step=True)`` ends every call in one
eager call's state: an optimizer that keeps a Python counter in its param group (Lookahead-style,
``CountingSGD``) has counted each optimizer step once, whatever the recording calls ran (the
network's probe, reference and capture; the optimizer step's reference and capture), and the
weights equal a plain fit's. On both backends, each test under a deadline."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from replaykit.lightning import ReplayCallback
from replaykit.protections import negative_control
from replaykit.testing.hazards.recording_call import CountingSGD

from ._fit import trainer


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    def _expired(signum: int, frame: object) -> None:
        raise TimeoutError("a Lightning call-state test ran past 180 s")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(180)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Counted(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return CountingSGD(self.net.parameters(), lr=0.1)


def _fit(callbacks: list, device: str) -> Counted:
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(48, 6))
    module = Counted()
    fit = trainer(callbacks=callbacks, accelerator="gpu" if device == "cuda" else "cpu", devices=1)
    fit.fit(module, DataLoader(data, batch_size=8))
    return module


def test_the_automatic_step_counts_each_optimizer_step_once(backend: str, device: str) -> None:
    eager = _fit([], device)
    cb = ReplayCallback("net", backend=backend, optimizer_step={"trust_optimizer": True})
    replayed = _fit([cb], device)
    assert replayed.optimizers().optimizer.param_groups[0]["k"] == 6  # six batches, six steps
    assert eager.optimizers().optimizer.param_groups[0]["k"] == 6
    for a, b in zip(replayed.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
    assert cb.recorders["net"].counts["replay"] >= 2, cb.recorders["net"].summary()


def test_without_the_call_state_the_recording_calls_count_twice() -> None:
    unsafe = list(negative_control("call_state"))
    step = {"trust_optimizer": True, "unsafe_disable": unsafe}
    replayed = _fit([ReplayCallback("net", backend="emulated", optimizer_step=step)], "cpu")
    assert replayed.optimizers().optimizer.param_groups[0]["k"] > 6
