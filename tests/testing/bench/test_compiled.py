"""The torch.compile benchmark's harness on the CPU: a process per size, rows merged, exactness reported."""

from __future__ import annotations

import pytest

from replaykit.testing.bench import compiled


@pytest.mark.e2e
def test_sizes_run_in_their_own_processes_and_keep_exactness() -> None:
    rows = compiled.run_isolated(
        (1,),
        sizes=("MLP 16x256 b32",),
        arms=("eager", "TrainStep"),
        device="cpu",
        warmup=2,
        rounds=1,
        per=2,
    )
    assert [(r.size, r.arm) for r in rows] == [
        ("MLP 16x256 b32", "eager"),
        ("MLP 16x256 b32", "TrainStep"),
    ]
    step = rows[1]
    assert step.equal is True and step.equal_to == "eager" and "replay" in step.note


@pytest.mark.e2e
def test_a_process_that_fails_leaves_rows_that_say_so() -> None:
    rows = compiled.run_isolated(
        (1,), sizes=(), zoo=("no_such_model",), arms=("eager",), device="cpu"
    )
    assert len(rows) == 1 and rows[0].median_ms is None and rows[0].note.startswith("crashed")
