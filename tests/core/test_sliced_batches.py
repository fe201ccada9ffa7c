"""Batches sliced from one preloaded tensor (``X[i:i+b]``, truncated BPTT's ``source[i:i+bptt]``)
move their storage offset every call. Network replay keyed the exact offset, so such a loop
recorded once per offset and then ran eagerly (``budget``), never replaying (hostile review); it
keys the address's alignment now, as the whole step does, and stays bitwise equal to eager."""

from __future__ import annotations

import torch
from torch import nn

import replaykit as rk


def _train(replay: bool) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(80, 8, generator=g), torch.randint(0, 4, (80,), generator=g)
    rec = rk.capture(net, backend="emulated") if replay else None
    for i in range(0, 80, 8):
        nn.functional.cross_entropy(net(X[i : i + 8]), Y[i : i + 8]).backward()
        opt.step()
        opt.zero_grad()
    counts = rec.counts if rec is not None else {}
    if rec is not None:
        rec.release()
    return [p.detach().clone() for p in net.parameters()], counts


def test_batches_sliced_from_a_preloaded_tensor_share_one_recording() -> None:
    eager, _ = _train(False)
    replayed, counts = _train(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    assert counts["record"] == 1 and counts["replay"] == 9 and counts["eager"] == 0
