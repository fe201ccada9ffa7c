"""Code that computes differently while a graph is being captured, or branches on its inputs' values.

Libraries branch on ``torch.cuda.is_current_stream_capturing()`` (Hugging Face's
``is_tracing()`` and its mask builders); the emulated backend answers True while it records,
so the CPU sees the same branch. Only an eager run of the recording call on the same state
(the recording's verification) can tell the recorded work from eager's. A library that has an
integration (``replaykit.verify.contexts``) is told during a recording what eager sees, and
takes eager's branch; the host read that branch makes (``if mask.all():``) is a function of the
batch alone, keyed per call (``input_reads``): padded and unpadded batches get a recording each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from replaykit.verify.contexts import register

from .pattern import MLP, Arm, Extras, Pattern, loop, sgd
from .writing import HazardClass, built, looped, stepped

HAZARD = "under_capture"
HC = HazardClass(HAZARD)


class CaptureAware(MLP):
    """Takes another (slightly different) path while a stream captures, as a library's fast path would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build has no CUDA runtime to ask
            capturing = False
        return out * (1 + 2**-10) if capturing else out


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


class Library:
    """Stands for a library that asks whether a graph is being captured before a host read
    (transformers' ``is_tracing()`` before ``padding_mask.all()``)."""

    capturing = staticmethod(_capturing)


@contextmanager
def _eager_branches() -> Iterator[None]:
    """This library's integration: during a recording it sees no capture (as transformers' does)."""
    saved = Library.__dict__["capturing"]
    Library.capturing = staticmethod(lambda: False)
    try:
        yield
    finally:
        Library.capturing = saved


register("replaykit.testing.hazards.under_capture", _eager_branches)


class MaskBranch(MLP):
    """Skips the mask when nothing is padded (a host read of the input mask), as attention does."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if mask.all():
            return out
        return out * mask.unsqueeze(-1).to(out.dtype) * (1 + 2**-10)


class LibraryMaskBranch(MLP):
    """Like transformers' mask builders: under a capture the read is skipped and the masked path taken."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not Library.capturing() and mask.all():
            return out
        return out * mask.unsqueeze(-1).to(out.dtype) * (1 + 2**-10)


def _mask(arm: Arm, step: int) -> torch.Tensor:
    """Every other batch has a padded row."""
    mask = torch.ones(4, dtype=torch.bool, device=arm.device)
    if step % 2:
        mask[3] = False
    return mask


def _mask_steps(model: torch.nn.Module, arm: Arm, steps: int = 6) -> Extras:
    step = arm.train_step(model, lambda m, x, mask: m(x, mask).pow(2).mean(), sgd(model))
    return {f"loss{i}": step(arm.randn(4, 6), _mask(arm, i)).detach() for i in range(steps)}


def _cpu_mask_steps(model: torch.nn.Module, arm: Arm, steps: int = 6) -> Extras:
    """The mask stays on the CPU (a collate function's): its read is a host read that a CUDA capture
    does not refuse, so only the input-read watch keys it there; its copy to the GPU is fed at each
    replay (backends/host_feeds.py)."""
    step = arm.train_step(
        model, lambda m, x, mask: m(x, mask.to(x.device)).pow(2).mean(), sgd(model)
    )
    return {f"loss{i}": step(arm.randn(4, 6), _mask(arm, i).cpu()).detach() for i in range(steps)}


class CpuMaskBranch(MLP):
    """Reads its CPU mask on the host first (a length or padding check), then moves it."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if bool(mask.all()):  # on the CPU: no device sync, nothing for a capture to refuse
            return out
        return out * mask.unsqueeze(-1).to(out.dtype) * (1 + 2**-10)


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


PATTERNS: list[Pattern] = [
    HC.pattern(
        "capture_time_branch",
        "forward branches on torch.cuda.is_current_stream_capturing()",
        built(CaptureAware),
        looped(steps=5),
        guard="verify_recording",
    ),
    HC.pattern(
        "capture_time_output_constant",
        "forward returns a host value computed under capture beside its output",
        built(CaptureFlag),
        looped(steps=5, loss=_flag_loss),
        guard="output_constants",
    ),
    HC.pattern(
        "step_capture_time_branch",
        "forward branches on is_current_stream_capturing(), whole step",
        built(CaptureAware),
        stepped(steps=6),
        guard="verify_recording",
        api="step",
    ),
    *HC.twins(
        "input_mask_branch",
        "forward branches on its input mask's .all(), padded and unpadded batches alternating",
        built(MaskBranch),
        lambda m, a: loop(m, a, steps=6, call=lambda m, x, i: m(x, _mask(a, i))),
        _mask_steps,
        step_what="forward branches on its input mask's .all(), whole step, padded and unpadded batches",
        guard="input_reads",
    ),
    HC.pattern(
        "step_cpu_mask_branch",
        "forward branches on a CPU mask's .all() (read on the host, moved after), whole step",
        built(CpuMaskBranch),
        _cpu_mask_steps,
        guard="input_reads",
        api="step",
        cpu_only="on CUDA the unsafe arm runs without the verification, whose reference run is where "
        "the step learns the host copies it feeds (backends/host_feeds.py): its capture fails and the "
        "step retires, exact (measured on the H200)",
    ),
    *HC.twins(
        "library_capture_branch",
        "a library skips the mask's host read while a graph is captured (transformers' is_tracing)",
        built(LibraryMaskBranch),
        lambda m, a: loop(m, a, steps=6, call=lambda m, x, i: m(x, _mask(a, i))),
        _mask_steps,
        step_what="a library skips the mask's host read while a graph is captured, whole step",
        guard="capture_branches",
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
