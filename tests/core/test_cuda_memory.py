"""CUDA only: a released or retired recorder gives its graphs' memory back."""

from __future__ import annotations

import gc

import pytest
import torch

import replaykit as rk
from replaykit.testing.nets import DetectionNet


@pytest.mark.parametrize("end", ["release", "retire"])
def test_memory_returns_to_baseline(cuda_device: str, end: str) -> None:
    torch.manual_seed(0)
    model = DetectionNet().to(cuda_device)
    x = torch.randn(8, 3, 16, 16, device=cuda_device)
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    rec = rk.capture(model)
    for i in range(4):
        y = x if i % 2 else x[:4]  # two recordings in the shared pool
        sum(o.square().mean() for o in model(y).values()).backward()
    assert rec.recordings == 2 and torch.cuda.memory_allocated() > baseline
    model.zero_grad(set_to_none=True)
    if end == "retire":
        rec.retire("test")
        model(x)  # eager, output dropped
    rec.release()
    del rec
    gc.collect()
    assert torch.cuda.memory_allocated() == baseline
