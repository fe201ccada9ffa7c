"""Shared fixtures: every semantic test runs on the emulated backend, and on CUDA where there is a GPU."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch

import replaykit as rk
from replaykit.verify.determinism import enable_determinism

HAS_CUDA = torch.cuda.is_available()
if HAS_CUDA:
    enable_determinism()  # parity with eager needs eager to repeat itself

BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")],
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend name; tests put their model on 'cuda' for the cuda backend, else on the CPU."""
    return request.param


@pytest.fixture
def device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


@pytest.fixture(autouse=True)
def _restore_global_flags() -> Iterator[None]:
    """Trainer(deterministic=True) and seed_everything set process-wide state; put it back."""
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "PL_GLOBAL_SEED")}
    yield
    torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _quiet_replay_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.ReplayWarning)
        yield


HEAVY_MARKS = ("slow", "ddp")
"""Markers of the tests that take seconds each (subprocesses, notebooks, DDP jobs)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that ask for the cuda-only fixture carry the marker too, so `-m cuda` selects them.

    Files holding a heavy test, and notebooks (nbval: `make test` collects notebooks/ in the same
    run), go first, the order within a file kept: under `-n 2 --dist loadfile --no-loadscope-reorder`
    a worker that draws one last is not left running it alone at the end.
    """
    for item in items:
        if "cuda_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cuda)
    heavy = {
        item.nodeid.split("::", 1)[0]
        for item in items
        if item.nodeid.split("::", 1)[0].endswith(".ipynb")
        or any(item.get_closest_marker(m) for m in HEAVY_MARKS)
    }
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in heavy)


@pytest.fixture
def cuda_device() -> str:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return "cuda"
