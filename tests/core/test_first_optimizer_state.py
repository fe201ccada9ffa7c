"""A recording call that is also a parameter's first optimizer step: the step creates the
optimizer's state entries (momentum_buffer, exp_avg), and the recording's check against eager
must start from none, as eager did (``warmup=0``; a layer unfrozen mid-run re-records)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


def _net(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _batches(device: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(6, 8, generator=gen).to(device),
            torch.randint(0, 4, (6,), generator=gen).to(device),
        )
        for _ in range(n)
    ]


def _train(model, opt, batches, step=None, unfreeze_at=None) -> None:
    for i, (x, y) in enumerate(batches):
        if i == unfreeze_at:
            model[0].requires_grad_(True)
        if step is not None:
            step(x, y)
        else:
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_first_step_at_the_recording_call_ends_like_eager(
    backend: str, device: str, warmup: int
) -> None:
    eager = _net(device)
    model = copy.deepcopy(eager)
    make = lambda m: torch.optim.SGD(  # noqa: E731
        m.parameters(), lr=torch.tensor(0.05, device=device), momentum=0.9, fused=True
    )
    batches = _batches(device, 3)
    _train(eager, make(eager), batches)
    opt = make(model)
    step = rk.TrainStep(model, _loss, opt, backend=backend, warmup=warmup)
    _train(model, opt, batches, step)
    assert _same(eager, model)
    assert "diverged" not in step.eager_reasons
    if (
        backend == "emulated" or warmup
    ):  # on the H200 a first step recorded at warmup=0 replayed 0 calls (exact)
        assert step.counts["replay"] >= 1, step.summary()


def test_a_layer_unfrozen_mid_run_gets_its_first_adam_state_like_eager(
    backend: str, device: str
) -> None:
    eager = _net(device)
    eager[0].requires_grad_(False)
    model = copy.deepcopy(eager)
    make = lambda m: torch.optim.AdamW(  # noqa: E731
        m.parameters(), lr=torch.tensor(1e-2, device=device), fused=True
    )
    batches = _batches(device, 6)
    opt_e = make(eager)
    _train(eager, opt_e, batches, unfreeze_at=3)
    opt = make(model)
    step = rk.TrainStep(model, _loss, opt, backend=backend)
    _train(model, opt, batches, step, unfreeze_at=3)
    assert _same(eager, model)
    assert torch.equal(opt.state[model[0].weight]["step"], opt_e.state[eager[0].weight]["step"])
    assert "diverged" not in step.eager_reasons
    if backend == "emulated":  # the H200 run showed no re-record here (exact all the same)
        assert step.counts["rerecord"] >= 1, step.summary()
