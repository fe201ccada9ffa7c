"""The whole-step arm of the parity matrix on a CPU (tiny)."""

from __future__ import annotations

from replaykit.testing.parity import step_matrix


def test_two_whole_step_scenarios_are_bitwise_and_their_unsafe_arms_diverge():
    scenarios = step_matrix.matrix(["detection"], ["32"], [1, 2], ["channels_last"])
    results = [step_matrix.run_scenario(s) for s in scenarios]
    summary = step_matrix.summary(results)
    assert summary["passed"] == summary["total"] == 2, step_matrix.rows(results)
    assert all(r["replays"] > 0 for r in step_matrix.rows(results))
