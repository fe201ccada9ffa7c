"""Host state a replay does not read again: host RNG draws, held containers and arrays changed in place."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("host_state"))
def test_host_state_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("host_state"))
def test_without_the_guard_host_state_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
