"""The shadow check: a sampled replayed call compared with eager; a difference retires with ``diverged``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.backends import resolve_backend
from replaykit.backends.base import Backend, Recording


class _Skewed(Recording):
    """A recording whose replays are off by one ULP in the chosen place: what no guard foresaw."""

    def __init__(self, inner: Recording, where: str) -> None:
        self._inner, self._where = inner, where

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def replay_forward(self) -> None:
        self._inner.replay_forward()
        if self._where == "output":
            out = self._inner.static_outputs[0]
            out.data.copy_(torch.nextafter(out, torch.full_like(out, float("inf"))))

    def backward(self, grads):
        result, how = self._inner.backward(grads)
        if self._where == "grad" and result[-1] is not None:
            g = result[-1]
            g.data.copy_(torch.nextafter(g, torch.full_like(g, float("inf"))))
        return result, how

    def exact_backward(self, grads):
        return self._inner.exact_backward(grads)

    def prepare_backward(self, grads):
        return self._inner.prepare_backward(grads)

    def free(self) -> None:
        self._inner.free()


class _SkewedBackend(Backend):
    def __init__(self, inner: Backend, where: str) -> None:
        self._inner, self._where = inner, where
        self.name = inner.name
        self.device = getattr(inner, "device", None)

    def record(self, subject):
        return _Skewed(self._inner.record(subject), self._where)

    def region(self, fixed):
        return self._inner.region(fixed)

    def free(self) -> None:
        self._inner.free()


def _net(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def _train(model: nn.Module, device: str, steps: int = 4) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 6, generator=g).to(device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _skewed_capture(model: nn.Module, backend: str, where: str, **kw) -> rk.Recorder:
    rec = rk.capture(model, backend=backend, **kw)
    rec.backend = _SkewedBackend(resolve_backend(backend, model), where)
    return rec


@pytest.mark.parametrize("where", ["output", "grad"])
def test_a_difference_retires_as_diverged_and_training_stays_eager_exact(
    backend: str, device: str, where: str
) -> None:
    eager = _train(_net(device), device)
    model = _net(device)
    # the recording's own verification would catch the skew first (see the test below): off here
    rec = _skewed_capture(
        model, backend, where, check_every=2, unsafe_disable=("verify_recording",)
    )
    replayed = _train(model, device)
    assert rec.retired and rec.retire_reason.startswith("diverged: ")
    assert ("output 0" if where == "output" else "grad 3.bias") in rec.retire_reason
    assert "1 ulp" in rec.retire_reason
    for k in eager:
        assert torch.equal(eager[k], replayed[k]), k
    rec.release()


@pytest.mark.parametrize("where", ["output", "grad"])
def test_without_the_check_the_difference_is_silent(backend: str, device: str, where: str) -> None:
    """The negative control: the skew is real, and only the checks see it."""
    eager = _train(_net(device), device)
    model = _net(device)
    rec = _skewed_capture(model, backend, where, unsafe_disable=("verify_recording",))
    replayed = _train(model, device)
    assert not rec.retired
    assert any(not torch.equal(eager[k], replayed[k]) for k in eager)
    rec.release()


@pytest.mark.parametrize("where", ["output", "grad"])
def test_a_new_recording_is_verified_once_and_a_difference_routes_its_signature_eager(
    backend: str, device: str, where: str
) -> None:
    """Code that computes differently under capture: the recording's first replay is compared with
    eager; a difference routes that signature eager (named in the journal), nothing lost."""
    eager = _train(_net(device), device)
    model = _net(device)
    rec = _skewed_capture(model, backend, where)
    replayed = _train(model, device)
    for k in eager:
        assert torch.equal(eager[k], replayed[k]), k
    assert not rec.retired and rec.counts["replay"] == 0 and rec.eager_reasons["diverged"] == 3
    refusal = next(e for e in rec.journal if e.kind == "refuse")
    assert ("output 0" if where == "output" else "grad 3.bias") in refusal.detail
    rec.release()


def test_checks_are_sampled_every_n_replayed_calls(backend: str, device: str) -> None:
    model = _net(device)
    rec = rk.capture(model, backend=backend, check_every=3)
    _train(model, device, steps=7)
    checks = [e for e in rec.journal if e.kind == "check"]
    assert [e.call for e in checks if e.reason == "forward"] == [1, 4, 7]
    assert all(e.detail is None for e in checks)  # equal: no difference named
    assert not rec.retired
    rec.release()


def test_check_every_is_validated() -> None:
    with pytest.raises(rk.ReplayError, match="check_every"):
        rk.capture(nn.Linear(2, 2), backend="emulated", check_every=-1)


def test_verification_reruns_eager_exactly_under_autocast_and_dropout(
    backend: str, device: str
) -> None:
    """The verification keeps no eager graph: at the backward it reruns eager's forward from the
    same state. Outside the autocast block and after the RNG moved on, that rerun must still be
    the forward's own (its autocast state and dropout masks), or every recording would be refused."""

    def run(capture: bool) -> tuple[dict[str, torch.Tensor], rk.Recorder | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
        model.to(device)
        rec = rk.capture(model, backend=backend) if capture else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(2)
        for _ in range(4):
            with torch.autocast(device, dtype=torch.bfloat16):
                out = model(torch.randn(5, 6, generator=g).to(device))
            torch.rand(3, device=device)  # the RNG moves on before the backward
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, rec

    eager, _ = run(False)
    replayed, rec = run(True)
    assert rec is not None and rec.counts["replay"] == 3, rec.summary()
    checks = [e for e in rec.journal if e.kind == "check"]
    assert checks and all(e.detail is None for e in checks), checks
    for k in eager:
        assert torch.equal(eager[k], replayed[k]), k
    rec.release()
