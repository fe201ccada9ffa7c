"""Gradients that leave the model: a GAN generator step through a trainable discriminator."""

from __future__ import annotations

import pytest

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("leaving_grads"))
def test_leaving_grads_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("leaving_grads"))
def test_without_the_guard_leaving_grads_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)
