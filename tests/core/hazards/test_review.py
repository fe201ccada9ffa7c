"""What the adversarial review found beyond the first catalogue: its fixed patterns run with
each class's tests (they are in the catalogue); here the documented limits and a lazy module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazard_patterns import KNOWN_LIMITS, PATTERNS
from replaykit.testing.hazard_review import REVIEW
from replaykit.testing.hazards import run_pattern


def test_the_reviews_patterns_are_in_the_catalogue() -> None:
    assert {p.name for p in REVIEW} <= {p.name for p in PATTERNS}
    assert not {p.name for p in KNOWN_LIMITS} & {p.name for p in PATTERNS}


@pytest.mark.parametrize("pat", KNOWN_LIMITS, ids=lambda p: p.name)
@pytest.mark.xfail(strict=True, reason="a known limit (README): still a silent difference; a fix makes this pass")
def test_known_limits_are_still_silent(pat) -> None:
    outcome = run_pattern(pat, "emulated")
    assert not outcome.failed, outcome.line()


def test_a_lazy_module_is_refused_clearly_until_materialized() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(rk.ReplayError, match="lazy"):
        rk.capture(model, backend="emulated")
    model(torch.randn(3, 5))  # materializes
    rk.capture(model, backend="emulated").release()
