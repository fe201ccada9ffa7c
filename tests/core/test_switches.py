"""Process-wide kernel switches are part of every recording's key: a flipped one never replays the old kernels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.guards import switches
from replaykit.protections import negative_control


class ConvNet(nn.Module):
    """A convolution: oneDNN's kernel and the native one sum in another order (other bits on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


@pytest.fixture(autouse=True)
def _switches_back() -> Iterator[None]:
    """Every test flips process-wide switches: put them all back."""
    before = switches.key()
    yield
    now = switches.key()
    for switch, value, current in zip(switches.SWITCHES, before, now, strict=True):
        if current != value:
            switch.set(value)


def _run(model: nn.Module, train: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list:
    """Five steps; oneDNN switched off before the fourth (a callback's switch mid-fit)."""
    torch.backends.mkldnn.enabled = True
    g = torch.Generator().manual_seed(3)
    losses = []
    for i in range(5):
        if i == 3:
            torch.backends.mkldnn.enabled = False
        losses.append(train(model, torch.randn(4, 3, 10, 10, generator=g)).detach())
    return [*losses, *(p.detach().clone() for p in model.parameters())]


def _capture_loop(model: nn.Module) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    return train


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager, model = ConvNet(), ConvNet()
    model.load_state_dict(eager.state_dict())
    return eager, model


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("unsafe", [(), negative_control("switches")], ids=["guarded", "unsafe"])
def test_capture_records_anew_when_onednn_is_switched_off(unsafe: tuple[str, ...]) -> None:
    eager, model = _models()
    reference = _run(eager, _capture_loop(eager))
    rec = rk.capture(model, backend="emulated", unsafe_disable=unsafe)
    replayed = _run(model, _capture_loop(model))
    records = [e.call for e in rec.journal if e.kind == "record"]
    rec.release()
    if unsafe:  # the recording's oneDNN kernels replay: other bits than eager's native ones
        assert not _equal(reference, replayed)
    else:
        assert _equal(reference, replayed)
        assert len(records) == 2 and records[1] == 4, (
            rec.journal.format()
        )  # the flip's call records


def _step_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).square().mean()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("unsafe", [(), negative_control("switches")], ids=["guarded", "unsafe"])
def test_a_whole_step_records_anew_when_onednn_is_switched_off(unsafe: tuple[str, ...]) -> None:
    eager, model = _models()
    twin = rk.TrainStep(
        eager, _step_loss, torch.optim.SGD(eager.parameters(), lr=0.1), replay=False
    )
    reference = _run(eager, lambda m, x: twin(x))
    step = rk.TrainStep(
        model,
        _step_loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        backend="emulated",
        unsafe_disable=unsafe,
    )
    replayed = _run(model, lambda m, x: step(x))
    records = [e.call for e in step.journal if e.kind == "record"]
    step.release()
    if unsafe:
        assert not _equal(reference, replayed)
    else:
        assert _equal(reference, replayed)
        assert len(records) == 2 and records[1] == 4, step.journal.format()


def test_a_switch_set_back_replays_its_earlier_recording() -> None:
    """Flipped and flipped back (a validation phase under another SDPA backend): two recordings, no more."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    rec = rk.capture(model, backend="emulated")
    for i in range(6):
        torch.backends.cuda.enable_flash_sdp(i % 2 == 0)
        model(torch.randn(3, 4)).sum().backward()
    assert rec.counts["record"] == 2 and rec.counts["replay"] == 4, rec.summary()
    rec.release()


def test_the_key_names_each_switch_and_sees_each_flip() -> None:
    """Every switch this torch has is read, and the flips readable on a CPU change the key."""
    assert len(switches.key()) == len(switches.SWITCHES) == len(set(switches.NAMES))
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(False)
    before = switches.key()
    torch.set_float32_matmul_precision("high")
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert {"float32_matmul_precision", "use_deterministic_algorithms"} <= set(
        switches.changed(before)
    )
    torch.set_float32_matmul_precision("highest")


def test_the_key_answers_where_legacy_and_new_tf32_settings_are_mixed() -> None:
    """torch >= 2.9 refuses to answer a legacy getter then: the key must not raise where eager runs."""
    if "cuda.matmul.fp32_precision" not in switches.NAMES:
        pytest.skip("this torch has no fp32_precision API")
    before = switches.key()
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    try:
        assert switches.MIXED in switches.key()
        assert switches.key() != before
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")


def test_frozen_runs_under_the_recorded_switches_and_puts_the_current_ones_back() -> None:
    torch.backends.mkldnn.enabled = True
    recorded = switches.key()
    torch.backends.mkldnn.enabled = False
    with switches.Frozen(recorded):
        assert torch.backends.mkldnn.enabled
    assert not torch.backends.mkldnn.enabled
