"""Inputs: mutated in place, aliased, non-contiguous or expanded, used around a skip; -0.0 and NaN arguments."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing.hazards.inputs import Angle, Centering, PairScore

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("inputs"))
def test_input_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("inputs"))
def test_without_the_guard_input_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


def _captured(
    cls: type, device: str, backend: str
) -> tuple[torch.nn.Module, torch.nn.Module, rk.Recorder]:
    torch.manual_seed(0)
    model, twin = cls().to(device), cls().to(device)
    twin.load_state_dict(model.state_dict())
    return model, twin, rk.capture(model, backend=backend)


def test_a_forward_that_mutates_its_input_changes_the_callers_tensor(
    backend: str, device: str
) -> None:
    model, _, rec = _captured(Centering, device, backend)
    try:
        for _ in range(3):  # record, then replays
            x = torch.randn(4, 6, device=device)
            expected = x - x.mean(dim=0, keepdim=True)
            model(x).sum().backward()
            assert torch.equal(x, expected)
        assert rec.counts["replay"] == 2 and not rec.retired, rec.journal
    finally:
        rec.release()


def test_negative_zero_is_not_the_recording_of_zero(backend: str, device: str) -> None:
    model, twin, rec = _captured(Angle, device, backend)
    try:
        x = torch.randn(4, 6, device=device)
        for offset in (0.0, 0.0, -0.0, -0.0, 0.0):
            out = model(x, offset)
            assert torch.equal(out, twin(x, offset)), offset
            out.sum().backward()
    finally:
        rec.release()


def test_the_same_tensor_twice_is_not_the_recording_of_two(backend: str, device: str) -> None:
    model, twin, rec = _captured(PairScore, device, backend)
    try:
        x = torch.randn(4, 6, device=device)
        for same in (False, False, True, True, False):
            y = x if same else x.clone()
            model.zero_grad(set_to_none=True)
            twin.zero_grad(set_to_none=True)
            model(x, y).sum().backward()
            twin(x, y).sum().backward()
            assert torch.equal(model.proj.weight.grad, twin.proj.weight.grad), same
    finally:
        rec.release()
