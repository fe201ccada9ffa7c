"""CUDA only: a released or retired recorder gives its graphs' memory back; a pool stays usable."""

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


def test_a_pool_whose_only_graph_was_freed_takes_the_next_capture(cuda_device: str) -> None:
    """Seen on the H200 ("use_count > 0 INTERNAL ASSERT"): a step's only recording dropped (a key
    refused as diverged) while its output lived on left the pool with no graph; the next key's
    capture into it failed and the step retired. The pool's anchor keeps it open."""
    from replaykit.backends.cuda import CudaBackend

    backend = CudaBackend(torch.device(cuda_device))
    x = torch.arange(4.0, device=cuda_device)
    first = backend.region([x])
    kept = first.capture(lambda: [x * 2])[0]  # a handed-out output the user still holds
    first.free()
    second = backend.region([x])
    out = second.capture(lambda: [x + 1])[0]  # raised before the anchor
    assert torch.equal(out, x + 1) and torch.equal(kept, x * 2)
    second.free()
