"""Autograd modes and transforms: anomaly detection, saved-tensor hooks, torch.func, checkpointing, inputs written before backward."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("autograd_modes"))
def test_autograd_modes_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("autograd_modes"))
def test_without_the_guard_autograd_modes_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
