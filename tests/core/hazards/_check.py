"""Shared assertions of the hazard tests: the safe arm must not fail, the unsafe arm must diverge."""

from __future__ import annotations

import pytest

from replaykit.testing.hazards import Outcome, Pattern, by_hazard, pattern, run_pattern
from replaykit.testing.hazards.outcome import REPLAYED


def _explain(o: Outcome) -> str:
    diffs = "\n  ".join(o.diffs[:8])
    return f"{o.pattern} on {o.backend}{' (unsafe)' if o.unsafe else ''}: {o.line()}\n  {diffs}\n  journal {o.journal}"


def assert_safe(name: str, backend: str) -> Outcome:
    """Replay ends bitwise equal to eager, or routes / retires / raises ReplayError: never a silent difference."""
    outcome = run_pattern(pattern(name), backend)
    assert not outcome.failed, _explain(outcome)
    return outcome


def assert_unsafe_diverges(name: str, backend: str) -> Outcome:
    """With the pattern's guard switched off the replay breaks the contract: the guard is needed."""
    pat = pattern(name)
    if pat.unsafe_never:
        pytest.skip(f"no backend here shows this unsafe arm diverging: {pat.unsafe_never}")
    if backend != "cuda" and pat.cuda_only:
        pytest.skip(f"the unsafe arm diverges only on CUDA: {pat.cuda_only}")
    if backend == "cuda" and pat.cpu_only:
        pytest.skip(f"the unsafe arm diverges only on the CPU: {pat.cpu_only}")
    outcome = run_pattern(pat, backend, unsafe=True)
    assert outcome.diverged, _explain(outcome)
    return outcome


def assert_replays(name: str, backend: str) -> Outcome:
    """Safe, and replayed (not merely routed): at least one call replayed, bitwise."""
    outcome = assert_safe(name, backend)
    assert outcome.kind == REPLAYED, _explain(outcome)
    return outcome


def names(hazard: str) -> list[str]:
    return [p.name for p in by_hazard(hazard)]


def guarded(hazard: str) -> list[str]:
    return [p.name for p in by_hazard(hazard) if p.guard is not None]


def of(name: str) -> Pattern:
    return pattern(name)
