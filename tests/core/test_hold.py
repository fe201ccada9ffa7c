"""The hold: while a replay's backward is pending, later forwards run eager."""

from __future__ import annotations

import gc

import pytest
import torch

import replaykit as rk
from replaykit.testing.nets import DetectionNet
from replaykit.testing.parity.trial import Trial, compare


@pytest.mark.parametrize("accumulation", [1, 2])
def test_two_forwards_before_one_backward_match_eager(
    backend: str, device: str, accumulation: int
) -> None:
    trial = Trial(steps=3, accumulation=accumulation, two_forwards=True, device=device)
    diffs, _, replay = compare(trial, DetectionNet, backend=backend)
    assert diffs == []
    assert replay.recorder["eager_reasons"]["hold"] == 3 * accumulation
    assert replay.recorder["replay"] >= 3 * accumulation - 1


def test_without_the_hold_two_forwards_diverge(backend: str, device: str) -> None:
    trial = Trial(steps=3, two_forwards=True, device=device)
    diffs, _, _ = compare(trial, DetectionNet, backend=backend, unsafe_disable=("hold",))
    assert any(d.name.startswith("grad/") and d.problem == "values" for d in diffs), diffs


def _model(device: str, backend: str):
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    return model, rk.capture(model, backend=backend)


def test_hold_released_by_backward(backend: str, device: str) -> None:
    model, rec = _model(device, backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    out = model(x)
    model(x)  # pending backward: eager
    sum(o.sum() for o in out.values()).backward()
    model(x)  # released: replays
    releases = [e.reason for e in rec.journal if e.kind == "hold_end"]
    assert "backward" in releases
    assert rec.eager_reasons["hold"] == 1
    assert rec.counts["replay"] == 1
    rec.release()


def test_hold_released_when_the_graph_is_dropped(backend: str, device: str) -> None:
    model, rec = _model(device, backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    model(x)  # output discarded at once: no backward will ever come
    gc.collect()
    model(x)
    model(x)
    assert rec.eager_reasons.get("hold", 0) == 0
    assert [e.reason for e in rec.journal if e.kind == "hold_end"][:1] == ["dropped"]
    assert rec.counts["replay"] == 2
    rec.release()


def test_retained_graph_differentiated_after_a_later_replay_raises(
    backend: str, device: str
) -> None:
    model, rec = _model(device, backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    loss = sum(o.sum() for o in model(x).values())
    loss.backward(retain_graph=True)
    model(x)  # replays: overwrites the activations the retained graph points at
    with pytest.raises(rk.ReplayError, match="overwrote its activations"):
        loss.backward()
    rec.release()
