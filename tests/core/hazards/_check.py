"""Shared assertions of the hazard tests: the safe arm must not fail, the unsafe arm must diverge."""

from __future__ import annotations

import pytest
import torch

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
    if pat.kernel_dependent and not outcome.diverged and not _lowered_precision_shows(backend):
        pytest.skip("this machine runs the same float32 matmul at every precision setting")
    assert outcome.diverged, _explain(outcome)
    return outcome


def _lowered_precision_shows(backend: str) -> bool:
    """Whether ``set_float32_matmul_precision("medium")`` changes a matmul here (oneDNN's bf16
    kernels on a CPU with avx512_bf16 or AMX; TF32 on a recent GPU): the kernel-dependent
    patterns' unsafe arms can only diverge where it does."""
    device = "cuda" if backend == "cuda" else "cpu"
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, 64, generator=g).to(device) for _ in range(2))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        exact = a @ b
        torch.set_float32_matmul_precision("medium")
        lowered = a @ b
    finally:
        torch.set_float32_matmul_precision(before)
    return not torch.equal(exact, lowered)


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
