"""The variable-length bucket benchmark on a CPU (tiny): every arm ends like eager, each bucket
records once, and memory reads n/a (nothing is measured off CUDA). Timings are not asserted."""

from __future__ import annotations

import pytest

from replaykit.testing.bench import buckets


@pytest.mark.slow
def test_bucket_bench_trains_like_eager_and_records_each_bucket_once():
    arms = ("eager", "TrainStep", "TrainStep per bucket, shared pool")
    rows = buckets.table(
        buckets.bench(2, "cpu", steps=8, batch=2, longest=8, dim=16, layers=1, arms=arms)
    )
    assert [r["arm"] for r in rows] == list(arms)
    assert all(r["equals_eager"] for r in rows)
    assert "records=2 " in rows[1]["note"], rows[1]["note"]
    table = buckets.markdown(rows)
    assert "| n/a | n/a | n/a | n/a |" in table


def _arm(name: str, step_ms: list[float]) -> buckets.ArmResult:
    return buckets.ArmResult("2 buckets", name, 0.0, 0.0, 0.0, 0.0, True, "", step_ms)


def test_break_even_is_where_the_run_so_far_stays_no_slower_than_eager():
    eager = _arm("eager", [5.0] * 6)
    # two recordings (12, 9 ms) then replays of 1 ms: 12>5, 13>10, 22>15, 23>20, 24<=25 from then on
    assert buckets.break_even(_arm("TrainStep", [12, 1, 9, 1, 1, 1]), eager) == 5
    # faster at first, slower at the end: no break-even
    assert buckets.break_even(_arm("TrainStep", [1, 1, 1, 1, 1, 30]), eager) is None
    # back above eager's, then below again: counted from the last crossing
    assert buckets.break_even(_arm("TrainStep", [1, 10, 1, 1, 1, 1]), eager) == 3
