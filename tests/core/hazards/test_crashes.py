"""Crashes where eager runs: an optimizer checkpoint round trip, an LSTM, LBFGS, backend="cuda"
without a GPU, a model that is not an nn.Module: exact, or a clear ReplayError."""

from __future__ import annotations

import pytest

from ._check import assert_safe, names


@pytest.mark.parametrize("name", names("crashes"))
def test_crashes_patterns_end_like_eager_or_raise_clearly(backend: str, name: str) -> None:
    assert_safe(name, backend)
