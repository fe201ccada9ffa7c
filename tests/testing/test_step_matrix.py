"""The whole-step arm of the parity matrix and its benchmark run on a CPU (tiny)."""

from __future__ import annotations

from replaykit.testing import step_bench, step_matrix
from replaykit.testing.bench import Size


def test_two_whole_step_scenarios_are_bitwise_and_their_unsafe_arms_diverge():
    scenarios = step_matrix.matrix(["detection"], ["32"], [1, 2], ["channels_last"])
    results = [step_matrix.run_scenario(s) for s in scenarios]
    summary = step_matrix.summary(results)
    assert summary["passed"] == summary["total"] == 2, step_matrix.rows(results)
    assert all(r["replays"] > 0 for r in step_matrix.rows(results))


def test_step_bench_compares_every_arm_with_eager():
    rows = step_bench.table(step_bench.run((Size("tiny", 2, 8, 4, 2),), device="cpu", steps=8, rounds=2))
    assert {r["arm"] for r in rows} == {"eager", "replaykit network", "replaykit step"}
    assert step_bench.summary(rows)["step_equal"]
