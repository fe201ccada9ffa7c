"""Live gradients are copied out at forward time, before every replay (the copy-out protection)."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.testing.nets import DetectionNet
from replaykit.testing.parity.trial import Trial, compare


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("accumulation", [2, 3])
def test_accumulation_matches_eager(
    backend: str, device: str, accumulation: int, set_to_none: bool
) -> None:
    trial = Trial(steps=3, accumulation=accumulation, set_to_none=set_to_none, device=device)
    diffs, _, replay = compare(trial, DetectionNet, backend=backend)
    assert diffs == []
    assert replay.recorder["eager"] == 0
    if (
        backend == "emulated"
    ):  # on CUDA AccumulateGrad may copy instead of adopting (layout contract)
        assert replay.recorder["copy_out"] >= 1


@pytest.mark.parametrize("way", ["move", "eager"])
def test_a_gradient_kept_by_a_callback_keeps_its_values(
    backend: str, device: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept after ``zero_grad(set_to_none=True)``: moved with its storage where torch can swap it
    (the calls replay), else the calls run eagerly while it is held (``live_alias``)."""
    if way == "eager":
        monkeypatch.setattr(copy_out, "_swap", None)
    elif not copy_out.holders_move():
        pytest.skip("this torch cannot move a held storage")
    trial = Trial(steps=3, accumulation=1, keep_grads=True, device=device)
    diffs, _, replay = compare(trial, DetectionNet, backend=backend)
    assert diffs == []
    live = replay.recorder["eager_reasons"].get("live_alias", 0)
    assert live >= 1 if way == "eager" else live == 0 and replay.recorder["copy_out"] >= 1


@pytest.mark.parametrize(
    ("trial", "what"),
    [
        (Trial(steps=3, accumulation=2), "grad/"),
        (Trial(steps=3, accumulation=1, set_to_none=False), "grad/"),
        (Trial(steps=3, accumulation=1, keep_grads=True), "kept_grad/"),
    ],
    ids=["accumulate", "zero_in_place", "callback"],
)
def test_without_copy_out_accumulation_diverges(
    backend: str, device: str, trial: Trial, what: str
) -> None:
    diffs, _, _ = compare(
        trial.with_(device=device), DetectionNet, backend=backend, unsafe_disable=("copy_out",)
    )
    assert any(d.name.startswith(what) and d.problem == "values" for d in diffs), diffs


def test_copy_out_happens_before_the_replay_at_forward_time(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    sum(o.sum() for o in model(x).values()).backward()  # record; .grad adopts static buffers
    sum(o.sum() for o in model(x).values()).backward()  # replay: copy-out first
    kinds = [e.kind for e in rec.journal if e.kind in ("record", "copy_out", "replay")]
    assert kinds[:3] == ["record", "copy_out", "replay"]
    before = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    model(x)  # the third forward copies out again: .grad moves to storage of its own
    after = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    assert before == after  # accumulating into own storage: nothing aliases any more
    rec.release()
