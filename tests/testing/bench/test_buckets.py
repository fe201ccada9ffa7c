"""The variable-length bucket benchmark on a CPU (tiny): every arm ends like eager, each bucket
records once, and memory reads n/a (nothing is measured off CUDA). Timings are not asserted."""

from __future__ import annotations

from replaykit.testing.bench import buckets


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
