"""The recording call runs the step's Python more than once: it must leave what one eager call leaves."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("recording_call"))
def test_recording_call_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("recording_call"))
def test_without_the_call_state_recording_call_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
