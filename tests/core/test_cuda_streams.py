"""CUDA only: replay keeps no parameter's AccumulateGrad node on the capture's side stream.

A leaf's AccumulateGrad node keeps the stream it was created on. Warm-up and capture
run on a side stream; had they used the real parameters, every later backward would
synchronise across streams once per parameter (replay at eager speed, seen on the
H200). Capture therefore runs on stand-in leaves. torch reports the mismatch with a
warning; ``make_graphed_callables`` triggers it on the same model, which shows the
check can fail.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.nets import DetectionNet

MISMATCH = "AccumulateGrad node's stream"


@contextmanager
def _every_warning() -> Iterator[list[warnings.WarningMessage]]:
    """Record warnings, including torch's once-per-process ones."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield seen
    finally:
        torch.set_warn_always(before)


def _mismatches(model: nn.Module, call: Callable[[torch.Tensor], dict], device: str) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, 16, 16, generator=g).to(device) for _ in range(4)]
    with _every_warning() as seen:
        for x in xs:
            sum(o.square().mean() for o in call(x).values()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    return sum(MISMATCH in str(w.message) for w in seen)


def test_replay_backward_waits_on_no_side_stream(cuda_device: str) -> None:
    torch.manual_seed(0)
    reference = DetectionNet().to(cuda_device)
    sample = torch.randn(4, 3, 16, 16, device=cuda_device)
    graphed = torch.cuda.make_graphed_callables(reference, (sample,))
    if not _mismatches(reference, graphed, cuda_device):
        pytest.skip("this torch does not warn about AccumulateGrad stream mismatches")
    torch.manual_seed(0)
    model = DetectionNet().to(cuda_device)
    rec = rk.capture(model)
    assert _mismatches(model, model, cuda_device) == 0
    assert rec.counts["replay"] == 3
