"""Backend differences: gradient sums of a reused weight, Adagrad's step count, an interrupt at recording, checkpointed dropout."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("backend_diffs"))
def test_backend_diffs_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("backend_diffs"))
def test_without_the_guard_backend_diffs_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
