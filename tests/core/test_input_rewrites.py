"""An input rewritten between a replayed forward and its backward without a version bump (a
numpy buffer a loader refills, a staging tensor written through ``.data``): the backward reads
the new values, as eager's saved tensor does (protection ``input_rewrites``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

Run = tuple[list[torch.Tensor], list[torch.Tensor | None], int]


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 8, generator=g) for _ in range(n)]


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _loop(how: str, device: str, replay: bool, disable: tuple[str, ...] = ()) -> Run:
    """Five steps; before each backward the next batch lands in the current batch's memory."""
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = _batches(6)
    buf = batches[0].numpy().copy()
    x = torch.from_numpy(buf) if how == "numpy" else batches[0].to(device)
    y = torch.arange(8, device=device) % 4
    rec = rk.capture(model, backend="emulated", unsafe_disable=disable) if replay else None
    losses = []
    try:
        for i in range(5):
            opt.zero_grad()  # set_to_none: the None pattern of an unread gradient shows
            loss = nn.functional.cross_entropy(model(x), y)
            if how == "numpy":
                buf[:] = batches[i + 1].numpy()
            else:
                x.data.copy_(batches[i + 1])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        replays = 0 if rec is None else rec.counts["replay"]
    finally:
        if rec is not None:
            rec.release()
    grads = [p.grad for p in model.parameters()]
    return losses + [p.detach() for p in model.parameters()], grads, replays


def _equal(a: Run, b: Run) -> bool:
    same = all(torch.equal(p, q) for p, q in zip(a[0], b[0], strict=True))
    return same and all(
        (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
        for g, h in zip(a[1], b[1], strict=True)
    )


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_an_input_rewritten_before_backward_is_read_as_eager_reads_it(how: str) -> None:
    eager = _loop(how, "cpu", replay=False)
    replayed = _loop(how, "cpu", replay=True)
    assert _equal(eager, replayed)
    assert replayed[2] == 4  # replayed, not routed eager


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_without_input_rewrites_the_backward_reads_the_forwards_copy(how: str) -> None:
    eager = _loop(how, "cpu", replay=False)
    with pytest.warns(rk.ReplayWarning):
        unsafe = _loop(how, "cpu", replay=True, disable=negative_control("input_rewrites"))
    assert unsafe[2] == 4 and not _equal(eager, unsafe)


def _two_backwards(replay: bool) -> list[torch.Tensor | None]:
    """Two forwards accumulated, then two backwards through one retained graph, the staging
    buffer rewritten before each backward."""
    model = _model("cpu")
    batches = _batches(4)
    x = batches[0].clone()
    rec = rk.capture(model, backend="emulated", multi_backward=True) if replay else None
    try:
        for _ in range(2):  # a recording call, then a replay
            model.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean() + model(x * 2).pow(2).mean()
            x.data.copy_(batches[1])
            loss.backward(retain_graph=True)
            x.data.copy_(batches[2])
            loss.backward()
        assert rec is None or rec.counts["replay"] >= 1, rec.journal.format()
    finally:
        if rec is not None:
            rec.release()
    return [p.grad for p in model.parameters()]


def test_accumulated_forwards_and_a_retained_graph_read_each_backwards_values() -> None:
    eager, replayed = _two_backwards(False), _two_backwards(True)
    assert all(torch.equal(g, h) for g, h in zip(eager, replayed, strict=True))


def test_a_numpy_input_the_forward_writes_in_place_is_written_back_then_read_again() -> None:
    """The forward centres its input in place (write-back) and the buffer is refilled after it."""

    class Centering(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model("cpu")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.sub_(x.mean(dim=0, keepdim=True))
            return self.net(x)

    def run(replay: bool) -> list[torch.Tensor]:
        model = Centering()
        batches = _batches(5)
        buf = batches[0].numpy().copy()
        x = torch.from_numpy(buf)
        rec = rk.capture(model, backend="emulated") if replay else None
        kept = []
        try:
            for i in range(4):
                model.zero_grad(set_to_none=True)
                buf[:] = batches[i].numpy()
                loss = model(x).pow(2).mean()
                kept.append(torch.from_numpy(buf.copy()))  # what the forward left in the buffer
                buf[:] = np.flip(batches[i + 1].numpy(), 0)
                loss.backward()
                kept += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
            assert rec is None or rec.counts["replay"] == 3, rec.journal.format()
        finally:
            if rec is not None:
                rec.release()
        return kept

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))
