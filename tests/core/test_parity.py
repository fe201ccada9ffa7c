"""Replay ends bitwise equal to eager: weights, buffers, every step's gradients with their None pattern."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing.nets import DetectionNet, DropoutNet
from replaykit.testing.parity.trial import Trial, compare, run


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_detection_replay_matches_eager(backend: str, device: str, accumulation: int) -> None:
    trial = Trial(steps=3, accumulation=accumulation, device=device)
    diffs, eager, replay = compare(trial, DetectionNet, backend=backend)
    assert diffs == []
    assert replay.recorder["record"] == 1
    assert replay.recorder["replay"] == 3 * accumulation - 1
    assert replay.recorder["retired"] is None
    assert any(k.startswith("buffer/") and "running_mean" in k for k in eager.state)


def test_dropout_replays_the_same_masks(backend: str, device: str) -> None:
    trial = Trial(steps=3, accumulation=2, features=12, batch=8, device=device)
    diffs, _, replay = compare(trial, DropoutNet, backend=backend)
    assert diffs == []
    assert replay.recorder["replay"] == 5


def test_channels_last_inputs(backend: str, device: str) -> None:
    diffs, _, replay = compare(
        Trial(accumulation=2, channels_last=True, device=device), DetectionNet, backend=backend
    )
    assert diffs == []
    assert replay.recorder["replay"] == 5


@pytest.mark.parametrize(
    "trial",
    [
        Trial(accumulation=2, channels_last_inputs=True),
        Trial(accumulation=2, loss="sum"),
        Trial(channels_last_inputs=True, loss="sum"),
    ],
    ids=["channels_last_inputs", "broadcast_grads", "both"],
)
def test_gradients_in_another_layout_than_the_outputs(
    backend: str, device: str, trial: Trial
) -> None:
    """The backward graph is captured for the layout the loss's gradients really have."""
    diffs, _, replay = compare(trial.with_(device=device), DetectionNet, backend=backend)
    assert diffs == []
    assert replay.recorder["replay"] == trial.steps * trial.accumulation - 1


def test_autocast_bf16(backend: str, device: str) -> None:
    trial = Trial(accumulation=2, autocast=torch.bfloat16, device=device)
    diffs, _, replay = compare(trial, DetectionNet, backend=backend)
    assert diffs == []
    assert replay.recorder["replay"] == 5


def test_the_recording_call_is_eager_exactly(backend: str, device: str) -> None:
    """Warm-up and capture leave no trace: outputs, BN stats, .grad, RNG as after one eager call."""

    def one_call(replay: bool):
        torch.manual_seed(0)
        model = DetectionNet().to(device)
        model.backbone[0][1].running_mean.add_(0.25)
        for p in list(model.parameters())[:3]:
            p.grad = torch.full_like(p, 0.5)
        rec = rk.capture(model, backend=backend, warmup=3) if replay else None
        torch.manual_seed(7)
        out = model(torch.randn(4, 3, 12, 12, device=device))
        after = {
            **{f"out/{k}": v.detach().clone() for k, v in out.items()},
            **{f"buf/{k}": v.clone() for k, v in model.named_buffers()},
            **{
                f"grad/{k}": None if p.grad is None else p.grad.clone()
                for k, p in model.named_parameters()
            },
            "cpu_rng": torch.get_rng_state(),
        }
        if device == "cuda":
            after["cuda_rng"] = torch.cuda.get_rng_state()
        if rec is not None:
            assert rec.counts["record"] == 1
            rec.release()
        return after

    from replaykit.verify.bitwise import diff_states

    assert diff_states(one_call(False), one_call(True)) == []


def test_replay_faster_path_is_really_taken(backend: str, device: str) -> None:
    """Guards against a parity test passing because everything silently ran eager."""
    outcome = run(Trial(steps=4, device=device), DetectionNet, {"backend": backend})
    assert outcome.recorder["replay"] == 3 and outcome.recorder["eager"] == 0
