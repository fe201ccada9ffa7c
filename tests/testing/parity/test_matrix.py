"""A representative slice of the parity matrix on CPU: every task, every precision, the diverging arms."""

from __future__ import annotations

import pytest

from replaykit.testing.parity import matrix
from replaykit.testing.parity.arms import run_arm, run_scenario, unsafe_arms
from replaykit.testing.parity.scenario import Scenario

SLICE = [
    Scenario(task="detection", precision="32", accumulation=2, layout="contiguous"),
    Scenario(task="pose", precision="bf16-mixed", accumulation=2, layout="channels_last"),
    Scenario(task="oriented", precision="16-mixed", accumulation=3, layout="partial_last"),
    Scenario(task="segmentation", precision="32", accumulation=1, layout="partial_between"),
    Scenario(task="detection", precision="16-mixed", accumulation=1, probe="two_forwards"),
    Scenario(task="pose", precision="32", accumulation=1, probe="keep_outputs"),
    Scenario(task="segmentation", precision="bf16-mixed", accumulation=2, probe="drop_head"),
]


@pytest.mark.parametrize("scenario", SLICE, ids=lambda s: s.name)
def test_slice_replays_equal_and_unsafe_arms_diverge(scenario: Scenario) -> None:
    arms = ["replay", *unsafe_arms(scenario)]
    result = run_scenario(scenario, arms)
    rows = {r["arm"]: r for r in matrix.rows([result])}
    assert rows["replay"]["equal"], result.diffs["replay"][:5]
    assert rows["replay"]["replays"] >= 1 and rows["replay"]["retired"] is None
    for arm in arms[1:]:
        assert not rows[arm]["equal"], f"{arm} did not diverge"
    assert result.passed


def test_matrix_shape_and_runner_yields_each_result() -> None:
    full = matrix.matrix()
    assert len(full) == 4 * 3 * 3 * 2 + 4 * 3 * 2  # 96 scenarios per arm
    small = matrix.matrix(
        tasks=["detection"],
        precisions=["32"],
        accumulations=[1],
        layouts=["contiguous"],
        partial_layouts=[],
    )
    results = list(matrix.run_matrix(small, with_unsafe=True, progress=False))
    assert len(results) == 1 and results[0].passed
    df = matrix.frame(results)
    assert list(df["arm"]) == ["replay"] and bool(df["ok"].all())


def test_bad_scenarios_fail_clearly() -> None:
    with pytest.raises(ValueError, match="precision"):
        run_arm(Scenario(precision="8-bit"))
    with pytest.raises(ValueError, match="arm"):
        run_arm(Scenario(), "sideways")


def test_the_replay_arm_with_the_shadow_check_stays_equal_and_counts_its_checks() -> None:
    scenario = Scenario(task="pose", precision="16-mixed", accumulation=2, check_every=2)
    result = run_scenario(scenario, ["replay"])
    summary = result.arms["replay"].recorder
    assert result.passed, result.diffs["replay"][:5]
    assert summary["check"] >= 2 and summary["retired"] is None


def test_no_scenarios_still_give_every_column() -> None:
    """A zoo-only parity run (tasks=[]): the notebook's tables select columns from an empty frame."""
    df = matrix.frame([])
    assert len(df) == 0 and {"scenario", "arm", "ok", "equal", "error"} <= set(df.columns)
    one = run_scenario(Scenario(task="detection", max_steps=1), ["replay"])
    assert set(matrix.rows([one])[0]) == set(matrix.frame([]).columns)
