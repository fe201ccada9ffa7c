"""Python a replay does not run around a whole step: hooks, what loss_fn reads, an optimizer's Python, the step's settings."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("step_python"))
def test_step_python_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("step_python"))
def test_without_the_guard_step_python_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
