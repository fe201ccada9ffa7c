"""Recurrent nets: captured they replay, packed sequences are keyed by their lengths, cuDNN's dropout
runs eagerly on CUDA."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("recurrent"))
def test_recurrent_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("recurrent"))
def test_without_the_lengths_key_packed_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
