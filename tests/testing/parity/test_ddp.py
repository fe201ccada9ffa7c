"""Lightning DDP on CPU processes (gloo, emulated backend): replay equals native on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replaykit.lightning import ReplayCallback, unsupported
from replaykit.testing.parity.ddp import compare
from replaykit.testing.parity.scenario import Scenario
from replaykit.testing.tasks import make_task


@pytest.mark.ddp
def test_ddp_replay_matches_native_on_every_rank_and_without_copy_out_diverges() -> None:
    """One torchrun job (the processes start once): replay equal to native on every rank, and the
    copy_out protection switched off (the unsafe arm) diverging while replay stays equal."""
    result = compare(
        Scenario(accumulation=2, devices=2), arms=("native", "replay", "unsafe:copy_out")
    )
    assert all(not d for d in result["diffs"]["replay"]) and result["ranks_agree"], result
    assert not any(result["errors"]["native"] + result["errors"]["replay"]), result["errors"]
    assert all(r["replay"] >= 1 for r in result["recorders"]["replay"])
    assert result["equal"] is False  # the unsafe arm differs...
    assert any(result["diffs"]["unsafe:copy_out"])  # ...on some rank


@pytest.mark.ddp
def test_ddp_replay_matches_native_on_every_rank_bf16() -> None:
    result = compare(Scenario(task="pose", precision="bf16-mixed", accumulation=1, devices=2))
    assert result["ok"], result
    assert all(r["replay"] >= 1 for r in result["recorders"]["replay"])


def test_unsupported_strategy_retires_every_recorder() -> None:
    task = make_task("detection")
    trainer = SimpleNamespace(strategy=type("FSDPStrategy", (), {})(), precision="32-true")
    assert "FSDPStrategy is not supported" in unsupported(trainer)
    cb = ReplayCallback("net")
    cb.on_fit_start(trainer, task)
    rec = cb.recorders["net"]
    assert rec.retired and "FSDPStrategy" in rec.retire_reason
    cb.on_fit_end(trainer, task)


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_parity_notebook_with_ddp(tmp_path) -> None:
    pytest.importorskip("papermill")
    from pathlib import Path

    from replaykit.workflow.runs import run_notebook

    root = Path(__file__).resolve().parents[3]
    # the zoo and the whole-step cells run on one device whatever `devices` says: test_notebooks.py runs them
    params = {
        "tasks": ["detection"],
        "accumulations": [2],
        "devices": 2,
        "with_unsafe": True,
        "models": [],
        "whole_step": False,
    }
    result = run_notebook(
        root / "notebooks" / "parity.ipynb", params, runs_dir=tmp_path, cwd=root, progress=False
    )
    assert result.ok, result.summary.get("failed_cell")
    assert (
        result.summary["results"]["replay_equal"] == 1
        and result.summary["results"]["unsafe_diverged"] == 1
    )


@pytest.mark.cuda
@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(accumulation=1, devices=2, device="cuda"),
        Scenario(accumulation=2, devices=2, device="cuda"),
        Scenario(precision="bf16-mixed", accumulation=2, devices=2, device="cuda"),
    ],
    ids=lambda s: s.name,
)
def test_cuda_ddp_two_gpus(scenario: Scenario) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    result = compare(
        scenario,
        arms=("native", "replay", "unsafe:copy_out")
        if scenario.accumulation > 1
        else ("native", "replay"),
    )
    assert all(not d for d in result["diffs"]["replay"]) and result["ranks_agree"], result
    assert all(r["replay"] >= 1 for r in result["recorders"]["replay"])


@pytest.mark.ddp
# (1, 24) is gone: that scenario (detection/32/acc1, clip 0.5 norm, 24 batches) is the first row of
# test_ddp_matrix.py, which runs the same native/replay/step job and checks the same facts per rank
@pytest.mark.parametrize("accumulation,n_train", [(2, 48)])
def test_ddp_network_replay_and_automatic_step_match_native_on_every_rank(
    accumulation: int, n_train: int
) -> None:
    scenario = Scenario(accumulation=accumulation, devices=2, n_train=n_train, clip=0.5)
    result = compare(scenario, ("native", "replay", "step"), timeout=180)
    assert result["ok"] and result["equal"] and result["ranks_agree"], result["diffs"]
    assert all(n >= 1 for n in result["step_replays"]), result["step_replays"]


@pytest.mark.ddp
def test_plain_torch_ddp_trainstep_and_capture_with_optimizer_step_are_exact() -> None:
    from replaykit.testing.parity.plain_ddp import compare as plain

    result = plain(world=2, steps=6, timeout=120)
    assert result["equal"] and result["ranks_agree"], result["diffs"]
    assert min(result["replays"]["trainstep"]) >= 1, result["summaries"]["trainstep"]
    assert min(result["replays"]["capture+step"]) >= 1
