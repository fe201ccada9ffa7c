"""CUDA only: a capture that fails leaves the process's random numbers usable, and replay exact."""

from __future__ import annotations

import torch
from torch import nn

import replaykit as rk


def test_a_failed_backward_capture_leaves_the_generator_usable(cuda_device: str) -> None:
    """Seen on the H200: an expanded input requiring grad invalidates the backward capture;
    without the reset every later random op raised 'Offset increment outside graph capture'."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 3)).to(cuda_device)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 3)).to(cuda_device)
    model.load_state_dict(eager.state_dict())
    rec = rk.capture(model)
    for m in (eager, model):
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(1, 6, device=cuda_device, requires_grad=True).expand(4, 6)
            m(x).square().sum().backward()
    torch.randn(3, device=cuda_device)  # raised before the fix
    for p, q in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert rec.counts["replay"] == 2
    rec.release()
