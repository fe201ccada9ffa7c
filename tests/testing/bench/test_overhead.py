"""The host-time tool runs, and its replaykit arms really replay (timings are not asserted)."""

from __future__ import annotations

from replaykit.testing.bench import overhead


def test_overhead_measures_replayed_calls():
    result = overhead.measure(blocks=2, calls=5, rounds=2)
    assert result["parameters"] == 8.0
    assert {"replaykit us", "replaykit, guards off us", "bare Function us", "added us"} <= set(
        result
    )
