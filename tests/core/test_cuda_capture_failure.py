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


def test_a_failed_capture_leaves_the_shared_pool_usable(cuda_device: str) -> None:
    """A capture invalidated by a host read ends with an error, which left the allocator routing
    into the pool: the next capture into it (another step sharing the ``rk.MemoryPool``, or this
    step capturing again, watched) failed with 'already recording to mempool_id'."""
    pool = rk.MemoryPool()

    def loss_fn(m, x):
        out = m(x).square().mean()
        return out * 2 if bool(m.weight.sum() > 0) else out  # a host read of the model's state

    torch.manual_seed(0)
    reads = nn.Linear(4, 4).to(cuda_device)
    plain = nn.Linear(4, 4).to(cuda_device)
    first = rk.TrainStep(reads, loss_fn, torch.optim.SGD(reads.parameters(), lr=0.1), pool=pool)
    second = rk.TrainStep(
        plain,
        lambda m, x: m(x).square().mean(),
        torch.optim.SGD(plain.parameters(), lr=0.1),
        pool=pool,
    )
    x = torch.randn(8, 4, device=cuda_device)
    for _ in range(3):
        first(x)
    assert first.retire_reason is not None and "capture failed" in first.retire_reason
    for _ in range(3):
        second(x)
    assert second.counts["record"] == 1 and second.counts["replay"] >= 1, second.summary()
