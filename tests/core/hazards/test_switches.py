"""Process-wide kernel switches flipped after recording: oneDNN/cuDNN off, an SDPA backend off, the matmul precision."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("switches"))
def test_switches_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("switches"))
def test_without_the_guard_switches_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
