"""The Lightning DDP bench as a smoke run on CPU processes (gloo): every arm times, replay replays."""

from __future__ import annotations

import math

import pytest

from replaykit.testing.bench.lightning_ddp import ARMS, NETWORK, STEP, run


@pytest.mark.ddp
@pytest.mark.e2e
@pytest.mark.parametrize("one_device", [False, True], ids=["ddp", "one-device"])
def test_ddp_bench_times_every_arm_and_replays_on_every_rank(one_device: bool) -> None:
    # one device: a DDPStrategy object per Trainer (a second Trainer refuses a used one)
    (result,) = run(["launch-bound"], "cpu", steps=6, one_device=one_device, timeout=180)
    for arm in (*ARMS, "allreduce"):
        assert len(result[arm]["per_rank_ms"]) == 2
        assert all(math.isfinite(ms) and ms > 0 for ms in result[arm]["per_rank_ms"]), result
    assert min(result[NETWORK]["net_replays"]) >= 1
    assert min(result[STEP]["step_replays"]) >= 1, result[STEP]
    assert result["allreduce"]["numel"] > 0
    assert result["line"].startswith("lightning ddp launch-bound x2 (")
