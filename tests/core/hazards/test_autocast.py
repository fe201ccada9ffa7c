"""A parameter used several times under autocast: eager shares one cast per region, a recording cannot."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("autocast"))
def test_autocast_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("autocast"))
def test_without_the_probe_autocast_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
