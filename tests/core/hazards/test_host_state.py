"""Host state a replay does not read again: host RNG draws, held containers and arrays changed in place."""

from __future__ import annotations

import pytest

from ._check import assert_replays, assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("host_state"))
def test_host_state_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("host_state"))
def test_without_the_guard_host_state_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


#: host state that replays now (not merely routes): a cache filled at a new length re-records;
#: Python's or numpy's draws that only choose are drawn before each call and key the recording
REPLAYING = [
    "rope_table_grown",
    "step_rope_table_grown",
    "layerdrop_python_random",
    "step_layerdrop_python_random",
    "step_random_task_in_loss",
    "stochastic_depth_numpy_coin",
    "step_stochastic_depth_numpy_coin",
]


@pytest.mark.parametrize("name", REPLAYING)
def test_host_state_that_changes_now_and_then_replays(backend: str, name: str) -> None:
    assert_replays(name, backend)
