"""Code that computes differently while a graph is captured: caught by the recording's verification."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("under_capture"))
def test_under_capture_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("under_capture"))
def test_without_the_guard_under_capture_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
