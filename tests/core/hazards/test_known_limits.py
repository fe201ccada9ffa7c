"""The documented limits (README, Known limits): still silent differences, kept out of the catalogue.

A limit found later goes into a module's ``KNOWN_LIMITS`` with a strict xfail here until a fix
makes it pass, and replay coverage leaves it out.
"""

from __future__ import annotations

import pytest

from replaykit.testing.hazards import KNOWN_LIMITS, PATTERNS, run_pattern


def test_known_limits_are_kept_out_of_the_catalogue() -> None:
    assert not {p.name for p in KNOWN_LIMITS} & {p.name for p in PATTERNS}


@pytest.mark.parametrize("pat", KNOWN_LIMITS, ids=lambda p: p.name)
@pytest.mark.xfail(
    strict=True, reason="a known limit (README): still a silent difference; a fix makes this pass"
)
def test_known_limits_are_still_silent(pat) -> None:
    outcome = run_pattern(pat, "emulated")
    assert not outcome.failed, outcome.line()
