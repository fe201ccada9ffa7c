"""CUDA only: host data a step copies to the GPU is copied again at each replay (host_feeds.py).

A CUDA capture refuses a copy from pageable host memory; before the feeds such a step retired
and ran eagerly for good. Each case here compares with the same loop run eagerly, bit for bit,
with host values that change every call (a frozen copy would differ)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import replaykit as rk


def _pair(device: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    model.load_state_dict(eager.state_dict())
    return eager, model


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(8, 6, generator=g)  # a DataLoader's CPU batch
        mask = torch.rand(8, generator=g) > (0.2 + 0.1 * (i % 3))
        out.append((x, mask))
    return out


def _compare(
    device: str, loss_fn: Callable, steps: int = 8
) -> tuple[rk.TrainStep, list[torch.Tensor], list[torch.Tensor]]:
    eager, model = _pair(device)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    step = rk.TrainStep(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    want, got = [], []
    for x, mask in _batches(steps):
        opt_e.zero_grad(set_to_none=True)
        loss = loss_fn(eager, x, mask)
        loss.backward()
        opt_e.step()
        want.append(loss.detach())
        got.append(step(x, mask).detach())
    for p, q in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    return step, want, got


def test_a_cpu_batch_moved_in_the_loss_replays(cuda_device: str) -> None:
    def loss_fn(m: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x, mask = x.to(cuda_device), mask.to(cuda_device, non_blocking=True)
        return (m(x).square().mean(-1) * mask.to(x.dtype)).sum()

    step, _, _ = _compare(cuda_device, loss_fn)
    assert step.retire_reason is None, step.summary()
    assert step.counts["replay"] >= 5, step.summary()
    step.release()  # its static memory goes now, not at a later test's garbage collection


def test_a_mask_computed_on_the_host_is_not_frozen(cuda_device: str) -> None:
    """``mask.float()`` runs on the CPU once during a capture: feeding its result would freeze the
    capture's mask (a silent difference). Its copy is left to fail: the step stays exact."""

    def loss_fn(m: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.float().to(cuda_device)  # computed on the host, then moved
        return (m(x.to(cuda_device)).square().mean(-1) * weights).sum()

    step, _, _ = _compare(cuda_device, loss_fn)
    step.release()


class _Held(nn.Module):
    """Scales by a CPU tensor it holds (a plain attribute, not a buffer) that the loop changes in place."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.gain = torch.ones(3)
        self.table = np.ones(3, dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x) * self.gain.to(x.device)
        return out * torch.tensor(self.table, device=x.device)


def test_held_host_tensors_and_arrays_changed_in_place(cuda_device: str) -> None:
    eager, model = _pair(cuda_device)
    eager, model = _Held(eager), _Held(model)
    rec = rk.capture(model)
    for m in (eager, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(2)
        for i in range(8):
            opt.zero_grad(set_to_none=True)
            m(torch.randn(8, 6, generator=g).to(cuda_device)).square().mean().backward()
            opt.step()
            m.gain.mul_(0.5)  # every call: a frozen copy would differ at once
            if i == 4:
                m.table *= 0.5
    for p, q in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert rec.counts["replay"] >= 4, rec.summary()
    rec.release()
