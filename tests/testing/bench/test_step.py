"""The whole-step benchmark on a CPU (tiny): every arm trains like eager (timings are not asserted)."""

from __future__ import annotations

from replaykit.testing.bench import step
from replaykit.testing.bench.timing import Size


def test_step_bench_compares_every_arm_with_eager():
    rows = step.table(step.run((Size("tiny", 2, 8, 4, 2),), device="cpu", steps=8, rounds=2))
    assert {r["arm"] for r in rows} == {
        "eager",
        "replaykit network",
        "replaykit step",
        step.CHECKED,
    }
    assert step.summary(rows)["step_equal"]
