"""Side effects in forward: private generators, tensor attributes, stored losses, data-dependent shapes."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing.hazards.side_effects import Warmup

from ._check import assert_replays, assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("side_effects"))
def test_side_effect_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("side_effects"))
def test_without_their_guard_they_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


@pytest.mark.parametrize("name", ["private_generator", "private_generator_replaced"])
def test_the_modules_own_generator_replays(backend: str, name: str) -> None:
    """Registered with the recording, it is drawn from at each replay as eager draws from it."""
    assert_replays(name, backend)


def test_a_python_counter_in_forward_counts_the_callers_calls(backend: str, device: str) -> None:
    """Warm-up and recording must not run the forward's Python side effects more often than eager."""
    torch.manual_seed(0)
    model = Warmup().to(device)
    rec = rk.capture(model, backend=backend)
    try:
        for _ in range(4):
            model(torch.randn(4, 6, device=device)).sum().backward()
        assert model.calls == 4, rec.journal.format()
    finally:
        rec.release()
