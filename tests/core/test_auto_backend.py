"""``backend="auto"`` on a CPU module says, once, that the emulated backend checks and does not speed up."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import replaykit as rk

ROOT = Path(__file__).resolve().parents[2]

# Three auto entry points and an explicit emulated one in a fresh process: exactly one warning,
# attributed to the user's line (this script), not to replaykit's internals.
SCRIPT = """
import warnings, torch, replaykit as rk
warnings.simplefilter("always", rk.ReplayWarning)
model = torch.nn.Linear(4, 2)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always", rk.ReplayWarning)
    rk.capture(torch.nn.Linear(4, 2), backend="emulated").release()
    rk.capture(model).release()
    rk.capture(model, backend="auto").release()
    rk.TrainStep(model, lambda m, x: m(x).sum(), torch.optim.SGD(model.parameters(), lr=0.1))
said = [w for w in seen if "backend='auto' uses the emulated backend" in str(w.message)]
print(len(said), said[0].filename if said else None)
"""


@pytest.mark.slow  # a fresh process: torch imports again
def test_auto_on_a_cpu_module_warns_once_per_process_and_names_the_users_line():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["1", "<string>"], out


def test_explicit_emulated_never_warns_about_speed():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", rk.ReplayWarning)
        with rk.capture(model, backend="emulated") as rec:
            model(torch.randn(3, 4)).sum().backward()
        step = rk.TrainStep(model, lambda m, x: m(x).sum(), opt, backend="emulated")
        step(torch.randn(3, 4))
    assert rec.counts["eager"] + rec.counts["record"] + rec.counts["replay"] >= 1
    assert step.counts["eager"] + step.counts["record"] + step.counts["replay"] >= 1
    assert not [w for w in seen if "uses the emulated backend" in str(w.message)], seen


def test_a_capture_failure_with_a_known_cause_says_what_to_do() -> None:
    """What the H200 raised when a held gradient accumulator belonged to the default stream (DDP
    built there, a GAN's eager discriminator loss still alive): the retire reason names the cause."""
    from replaykit.backends import capture_failure

    raised = RuntimeError(
        "CUDA error: operation would make the legacy stream depend on a capturing blocking stream\n"
        "Search for `cudaErrorStreamCaptureImplicit' in https://docs.nvidia.com/cuda/"
    )
    why = capture_failure(raised)
    assert why.startswith("capture failed: the backward had to make the default CUDA stream wait")
    assert "del loss" in why and "side stream" in why and "cudaErrorStreamCaptureImplicit" in why
    other = capture_failure(ValueError("something else"))
    assert other == "capture failed: ValueError: something else"
