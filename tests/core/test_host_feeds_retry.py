"""The route around a capture that refused a host-to-device copy (CUDA's "unless the CPU tensor
is pinned"), on the CPU backend: the emulated tape never refuses one, so the refusal is injected
where a CUDA backend raises it. The step captures again with host feeds within the same call;
``rk.capture`` runs that call eagerly and records the next one with them. Either way every call
ends as eager's (backends/host_feeds.py; the feeds themselves run on CUDA only: test_cuda_host_feeds.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.backends import emulated

REFUSAL = (
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is "
    "pinned. Please use tensor.pin_memory() or allocate the tensor with pin_memory=True."
)


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Captures without host feeds raise CUDA's refusal; the list gathers what each capture asked."""
    asked: list[object] = []
    capture, record = emulated.TapeRegion.capture, emulated.EmulatedBackend.record

    def region_capture(self, body, host_feeds=None):
        asked.append(host_feeds)
        if host_feeds is None:  # CUDA refuses at the copy, after the body's earlier work ran
            capture(self, body, host_feeds)
            raise RuntimeError(REFUSAL)
        return capture(self, body, host_feeds)

    def backend_record(self, subject):
        asked.append(subject.host_feeds)
        if not subject.host_feeds:
            raise RuntimeError(REFUSAL)
        return record(self, subject)

    monkeypatch.setattr(emulated.TapeRegion, "capture", region_capture)
    monkeypatch.setattr(emulated.EmulatedBackend, "record", backend_record)
    return asked


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict(eager.state_dict())
    return eager, model


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g) for _ in range(n)]


def test_the_step_captures_again_with_host_feeds_in_the_same_call(refusing: list) -> None:
    """The refused attempt and the retry run the body more than once: the call still ends in one
    eager call's state (dropout's draws included: the two arms run from one seed each)."""
    eager, model = _pair()
    eager.insert(1, nn.Dropout(0.25))
    model.insert(1, nn.Dropout(0.25))
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch.manual_seed(5)
    want = []
    for x in _batches(6):
        opt_e.zero_grad(set_to_none=True)
        loss = loss_fn(eager, x)
        loss.backward()
        opt_e.step()
        want.append(loss.detach())
    eager_rng = torch.get_rng_state()
    step = rk.TrainStep(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(5)
    got = [step(x) for x in _batches(6)]
    step_rng = torch.get_rng_state()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert all(
        torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters(), strict=True)
    )
    assert torch.equal(step_rng, eager_rng)  # as many draws as eager's, no more
    assert refusing[0] is None and refusing[1] is not None, refusing
    assert step.retire_reason is None and step.counts["replay"] == 4, step.summary()
    assert any(e.reason == "host_feeds" for e in step.journal), step.journal.format()


def test_capture_runs_the_refused_call_eagerly_and_records_the_next_with_host_feeds(
    refusing: list,
) -> None:
    eager, model = _pair()
    rec = rk.capture(model)
    for m in (eager, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x in _batches(6):
            opt.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            opt.step()
    assert all(
        torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters(), strict=True)
    )
    assert refusing == [False, True], refusing
    assert not rec.retired and rec.eager_reasons.get("host_feeds") == 1, rec.summary()
    assert rec.counts["replay"] >= 3, rec.summary()


def test_a_second_refusal_retires_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host feeds on and the copy still refused (a source computed on the host is never fed): the
    step retires, as it did before feeds existed, and trains on eagerly."""

    def always(self, body, host_feeds=None):
        raise RuntimeError(REFUSAL)

    monkeypatch.setattr(emulated.TapeRegion, "capture", always)
    eager, model = _pair()
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    step = rk.TrainStep(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    for x in _batches(4):
        opt_e.zero_grad(set_to_none=True)
        loss_fn(eager, x).backward()
        opt_e.step()
        step(x)
    assert all(
        torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters(), strict=True)
    )
    assert step.retire_reason is not None and "pinned" in step.retire_reason, step.summary()
