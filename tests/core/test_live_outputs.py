"""Outputs the caller still holds keep their values when later replays run."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.memory import copy_out
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


def _keep_views(backend: str, device: str, calls: int = 5, **capture) -> tuple[list, list, object]:
    """An epoch metric's loop: each call's output kept as ``.detach()`` and as a view of it (tensors
    copy-out cannot reach through the output), with their values at the time they were kept."""
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = rk.capture(model, backend=backend, **capture) if backend else None
    kept, values = [], []
    for i in range(calls):
        out = model(torch.randn(2, 3, 8, 8, device=device) + i)
        sum(o.square().mean() for o in out.values()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cls = out["o2m_cls"].detach()
        kept += [cls, cls[:, :1]]
        values += [cls.clone(), cls[:, :1].clone()]
    return kept, values, rec


@pytest.mark.parametrize("way", ["move", "copies"])
def test_held_views_of_outputs_keep_their_values_and_the_calls_replay(
    backend: str, device: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held outputs keep their values both ways copy-out has: moving them (torch with the storage
    swap) and handing out copies (as on a torch without it)."""
    if way == "copies":
        monkeypatch.setattr(copy_out, "_swap", None)
    elif not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip("this torch cannot move a held storage: it hands out copies")
    kept, values, rec = _keep_views(backend, device)
    eager, _, _ = _keep_views("", device)
    assert all(torch.equal(k, v) for k, v in zip(kept, values, strict=True))
    assert all(torch.equal(k, e) for k, e in zip(kept, eager, strict=True))
    assert rec.counts["replay"] == 4 and not rec.eager_reasons, rec.journal.format()
    if way == "move":
        assert rec.counts["copy_out"] >= 4, rec.journal.format()
    rec.release()
    # the recording is gone: what was handed out holds memory of its own
    assert all(torch.equal(k, v) for k, v in zip(kept, values, strict=True))


def test_without_live_outputs_held_views_are_overwritten(backend: str, device: str) -> None:
    with pytest.warns(rk.ReplayWarning):
        kept, values, rec = _keep_views(backend, device, unsafe_disable=("live_outputs",))
    assert rec.counts["replay"] == 4
    assert not all(torch.equal(k, v) for k, v in zip(kept, values, strict=True))


def test_a_collected_recorder_leaves_held_outputs_their_values() -> None:
    """A handed-out output does not own the static memory: a recorder collected while the caller
    still holds outputs moves them to memory of their own first."""
    import gc

    kept, values, rec = _keep_views("emulated", "cpu")
    del rec
    gc.collect()
    junk = [torch.full_like(v, 7.0) for v in values for _ in range(4)]  # reuse of freed memory
    assert all(torch.equal(k, v) for k, v in zip(kept, values, strict=True))
    del junk


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
