"""Parameters eager leaves at .grad None stay None under replay."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing.nets import DetectionNet
from replaykit.testing.parity.trial import Trial, compare
from tests.nets import Branchy


@pytest.mark.parametrize("accumulation", [1, 2])
def test_unread_outputs_leave_none(backend: str, device: str, accumulation: int) -> None:
    trial = Trial(steps=3, accumulation=accumulation, read=(0, 2), device=device)
    diffs, eager, replay = compare(trial, DetectionNet, backend=backend)
    assert diffs == []
    assert eager.state["grad/step0/o2m_box.weight"] is None
    assert eager.state["grad/step0/o2m_cls.weight"] is not None
    assert replay.recorder["eager"] == 0
    if (
        backend == "emulated"
    ):  # eager through the recorded graph; CUDA captures its graph for these heads
        assert replay.recorder["backward_reasons"]["partial"] >= 1


def test_without_the_none_pattern_unread_heads_get_zeros(backend: str, device: str) -> None:
    trial = Trial(steps=2, read=(0,), device=device)
    diffs, _, _ = compare(trial, DetectionNet, backend=backend, unsafe_disable=("none_pattern",))
    assert any(d.problem == "none_pattern" and "o2m_box" in d.name for d in diffs), diffs


def test_an_unused_branch_stays_none(backend: str, device: str) -> None:
    trial = Trial(steps=3, accumulation=2, features=6, device=device)
    diffs, eager, replay = compare(trial, Branchy, backend=backend)
    assert diffs == []
    assert eager.state["grad/step0/unused.weight"] is None
    assert replay.recorder["replay"] == 5


def test_input_gradients_flow_and_are_copies(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = Branchy().to(device)
    twin = Branchy().to(device)
    twin.load_state_dict(model.state_dict())
    rec = rk.capture(model, backend=backend)
    grads = []
    for m in (twin, model, model):
        torch.manual_seed(1)
        x = torch.randn(3, 6, device=device).requires_grad_()
        a, b = m(x)
        (a.sum() + b.square().sum()).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
    assert grads[1].data_ptr() != grads[2].data_ptr()
    assert rec.counts["replay"] == 1
    rec.release()
