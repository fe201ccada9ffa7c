"""A captured module called again before the previous call's backward (two views of a batch in
one autocast region, a weight-tied block called twice): exact from the first step."""

from __future__ import annotations

import copy

import torch
from torch import nn

import replaykit as rk


def _encoder(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(device)


def _train(model: nn.Module, device: str, views: int, steps: int = 4) -> list[torch.Tensor]:
    """A contrastive-style loop: ``views`` forwards of the encoder in one bf16 autocast region."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = sum((k + 1) * model(x * (k + 1)).float().pow(2).mean() for k in range(views))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _run(device: str, backend: str, views: int, **kw) -> tuple[list, list, rk.Recorder]:
    eager_model = _encoder(device)
    model = copy.deepcopy(eager_model)
    rec = rk.capture(model, backend=backend, **kw)
    return _train(eager_model, device, views), _train(model, device, views), rec


def test_two_calls_in_one_autocast_region_route_eager_from_the_first_step(
    backend: str, device: str
) -> None:
    eager, replayed, rec = _run(device, backend, views=2)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    assert rec.counts["replay"] == 0
    assert rec.eager_reasons["first_use"] == 1
    assert rec.eager_reasons["autocast_shared_region"] == 7
    assert rec.counts["warned"] == 0


def test_one_call_per_autocast_region_replays_after_its_watched_first_use(
    backend: str, device: str
) -> None:
    eager, replayed, rec = _run(device, backend, views=1)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    assert dict(rec.eager_reasons) == {"first_use": 1}
    assert rec.counts["replay"] == 3


def test_without_the_reentry_protection_two_calls_differ_silently(
    backend: str, device: str
) -> None:
    eager, replayed, rec = _run(
        device, backend, views=2, unsafe_disable=("reentry", "verify_recording")
    )
    assert not all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    assert rec.counts["warned"] == 0


def test_a_watched_call_whose_graph_is_dropped_is_watched_again(backend: str, device: str) -> None:
    model = _encoder(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(5, 6, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        model(x)  # its result is dropped: no backward, and no second call while it lived
        model(x).float().sum().backward()
        model(x).float().sum().backward()
    assert rec.eager_reasons["first_use"] == 2
    assert "autocast_shared_region" not in rec.eager_reasons
    assert rec.counts["replay"] == 1
