"""CUDA only: the callback on a GPU — parity at each precision, and memory back to baseline after fit."""

from __future__ import annotations

import gc

import lightning as L
import pytest
import torch

from replaykit.lightning import ReplayCallback
from replaykit.testing.parity.arms import run_scenario, step_unsafe_arms, unsafe_arms
from replaykit.testing.parity.scenario import Scenario
from replaykit.testing.tasks import make_datamodule, make_task


@pytest.mark.parametrize("precision", ["32", "16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_cuda_trainer_parity(cuda_device: str, precision: str, accumulation: int) -> None:
    scenario = Scenario(
        task="detection",
        precision=precision,
        accumulation=accumulation,
        device=cuda_device,
        ema=0.9,
    )
    result = run_scenario(scenario, ["replay", *unsafe_arms(scenario)])
    assert result.passed, {a: [d.name for d in ds][:5] for a, ds in result.diffs.items()}
    assert result.arms["replay"].recorder["replay"] >= 4


def _leftover(cuda_device: str, replay: bool) -> int:
    """Memory a fit leaves allocated once its trainer is gone (model, optimizer state, ...)."""
    gc.collect()
    base = torch.cuda.memory_allocated()
    L.seed_everything(0, verbose=False)
    task = make_task("segmentation").to(cuda_device)
    cb = ReplayCallback("net")
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[cb] if replay else [],
    )
    trainer.fit(task, datamodule=make_datamodule("segmentation"))
    if replay:
        assert cb.recorders["net"].counts["replay"] >= 4
    task.zero_grad(set_to_none=True)
    del trainer, cb
    gc.collect()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - base
    del task
    gc.collect()
    return left


def test_cuda_fit_leaves_no_more_memory_than_native(cuda_device: str) -> None:
    assert _leftover(cuda_device, replay=True) == _leftover(cuda_device, replay=False)


@pytest.mark.parametrize("precision", ["32", "16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_cuda_automatic_step_parity(cuda_device: str, precision: str, accumulation: int) -> None:
    """ReplayCallback(optimizer_step=True) on a GPU: the optimizer step a CUDA graph, bitwise native."""
    scenario = Scenario(
        task="detection",
        precision=precision,
        accumulation=accumulation,
        device=cuda_device,
        # fused SGD (a tensor lr the scheduler moves on the device) where Lightning lets it clip
        # (32) or where the GradScaler needs it (16-mixed, unclipped); under bf16-mixed Lightning
        # refuses clipping with a fused optimizer: plain SGD, without a schedule (a float lr moved
        # every step records anew every step)
        optimizer="sgd" if precision == "bf16-mixed" else "sgd-fused",
        n_train=48,
        clip=None if precision == "16-mixed" else 0.5,
        scheduler=None if precision == "bf16-mixed" else "cosine",
    )
    result = run_scenario(scenario, ["step", *step_unsafe_arms(scenario)])
    assert result.passed, {a: [d.name for d in ds][:5] for a, ds in result.diffs.items()}
    assert result.arms["step"].recorder["optimizer_step"]["replay"] >= 1


def test_cuda_automatic_step_resumes_from_a_checkpoint_and_keeps_replaying(
    cuda_device: str,
) -> None:
    """fit(ckpt_path=...) under ReplayCallback(optimizer_step=True) on a GPU: the resumed fit's
    optimizer step (fused SGD, its state from the checkpoint) replays, bitwise native."""
    scenario = Scenario(
        task="pose",
        accumulation=2,
        resume=True,
        optimizer="sgd-fused",
        clip=1.0,
        device=cuda_device,
    )
    result = run_scenario(scenario, ["step"])
    assert result.passed, {a: [d.name for d in ds][:5] for a, ds in result.diffs.items()}
    resumed = result.arms["step"].recorder["optimizer_step"]  # the last (resumed) fit's
    assert resumed["replay"] >= 1, resumed
