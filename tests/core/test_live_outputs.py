"""Outputs the caller still holds keep their values when later replays run."""

from __future__ import annotations

import torch

import replaykit as rk
from replaykit.testing.nets import DetectionNet
from replaykit.testing.parity.trial import Trial, compare


def test_held_outputs_keep_their_values(backend: str, device: str) -> None:
    diffs, eager, replay = compare(
        Trial(steps=3, keep_outputs=True, device=device), DetectionNet, backend=backend
    )
    assert diffs == []
    assert any(k.startswith("kept_output/") for k in eager.state)
    assert replay.recorder["replay"] == 2


def test_without_live_outputs_held_outputs_change(backend: str, device: str) -> None:
    diffs, _, _ = compare(
        Trial(steps=3, keep_outputs=True, device=device),
        DetectionNet,
        backend=backend,
        unsafe_disable=("live_outputs",),
    )
    assert any(d.name.startswith("kept_output/") for d in diffs), diffs


def test_a_held_view_of_an_output_routes_eager(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    out = model(x)
    view = out["o2m_cls"].detach()[
        :, :1
    ]  # unreachable for copy-out: another tensor on the same storage
    kept = view.detach().clone()
    del out
    model(x + 1)
    assert rec.eager_reasons["live_alias"] == 1
    assert torch.equal(view, kept)
    del view
    model(x + 2)
    assert rec.counts["replay"] == 1
    rec.release()


def test_held_outputs_keep_their_values_when_backwards_run_exactly(
    backend: str, device: str
) -> None:
    """multi_backward: no backward hands out gradient buffers, so copy-out reads only the outputs' use counts."""
    trial = Trial(steps=3, accumulation=2, keep_outputs=True, device=device)
    diffs, _, replay = compare(trial, DetectionNet, backend=backend, multi_backward=True)
    assert diffs == []
    assert (
        replay.recorder["replay"] >= 4
        and replay.recorder["backward_reasons"].get("multi_backward", 0) >= 4
    )
    diffs, _, _ = compare(
        trial, DetectionNet, backend=backend, multi_backward=True, unsafe_disable=("live_outputs",)
    )
    assert any(d.name.startswith("kept_output/") for d in diffs), diffs


def test_the_recorders_own_references_are_in_the_use_count_baseline() -> None:
    """An output that is a view of an input (record_probe off) shares a static input's storage, which
    the recorder also references to copy inputs in: copy-out must still find it unaliased."""
    import warnings

    from replaykit.testing.hazards.inputs import ReturnsInputView

    torch.manual_seed(0)
    model = ReturnsInputView()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.ReplayWarning)
        rec = rk.capture(model, backend="emulated", unsafe_disable=("record_probe",))
    for _ in range(3):
        y, view = model(torch.randn(4, 6))
        del view
        y.sum().backward()
    assert rec.counts["replay"] == 2 and rec.eager_reasons.get("live_alias", 0) == 0, (
        rec.journal.format()
    )
    rec.release()
