"""Code that computes differently while a graph is being captured.

Libraries branch on ``torch.cuda.is_current_stream_capturing()`` (Hugging Face's
``is_tracing()`` and its mask builders); the emulated backend answers True while it records,
so the CPU sees the same branch. Only an eager run of the recording call on the same state
(the recording's verification) can tell the recorded work from eager's.
"""

from __future__ import annotations

import torch

from .pattern import MLP, Pattern, loop, step_loop


class CaptureAware(MLP):
    """Takes another (slightly different) path while a stream captures, as a library's fast path would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build has no CUDA runtime to ask
            capturing = False
        return out * (1 + 2**-10) if capturing else out


class CaptureFlag(MLP):
    """Returns, beside its output, a host value computed while a stream captures (a library's
    fast-path flag): a recording would hand back the captured value at every replay."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor | bool]:
        out = super().forward(x)
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build has no CUDA runtime to ask
            capturing = False
        return {"out": out, "fast_path": capturing}


def _flag_loss(out: dict) -> torch.Tensor:
    return out["out"].pow(2).mean() * (2.0 if out["fast_path"] else 1.0)


HAZARD = "under_capture"

PATTERNS: list[Pattern] = [
    Pattern(
        "capture_time_branch",
        HAZARD,
        "forward branches on torch.cuda.is_current_stream_capturing()",
        lambda d: CaptureAware().to(d),
        lambda m, a: loop(m, a, steps=5),
        guard="verify_recording",
    ),
    Pattern(
        "capture_time_output_constant",
        HAZARD,
        "forward returns a host value computed under capture beside its output",
        lambda d: CaptureFlag().to(d),
        lambda m, a: loop(m, a, steps=5, loss=_flag_loss),
        guard="output_constants",
    ),
    Pattern(
        "step_capture_time_branch",
        HAZARD,
        "forward branches on is_current_stream_capturing(), whole step",
        lambda d: CaptureAware().to(d),
        lambda m, a: step_loop(m, a, steps=6),
        guard="verify_recording",
        api="step",
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
