"""Parameters presented another way: functional_call, stateless weights, parametrizations."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import replaykit as rk
from replaykit.testing.hazards.pattern import MLP

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("parameters"))
def test_parameter_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("parameters"))
def test_without_param_identity_they_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


def test_functional_call_uses_the_parameters_it_is_given(backend: str, device: str) -> None:
    """After recording, functional_call(model, other, x): other's values, and gradients into other."""
    torch.manual_seed(0)
    model, twin = MLP().to(device), MLP().to(device)
    twin.load_state_dict(model.state_dict())
    rec = rk.capture(model, backend=backend)
    try:
        for _ in range(2):
            model(torch.randn(4, 6, device=device)).sum().backward()
        x = torch.randn(4, 6, device=device)
        other = {n: torch.randn_like(p).requires_grad_() for n, p in model.named_parameters()}
        twin_other = {n: t.detach().clone().requires_grad_() for n, t in other.items()}
        try:
            out = functional_call(model, other, (x,))
            out.pow(2).sum().backward()
        except rk.ReplayError:
            return
        ref = functional_call(twin, twin_other, (x,))
        ref.pow(2).sum().backward()
        assert torch.equal(out, ref)
        for n in other:
            assert torch.equal(other[n].grad, twin_other[n].grad), n
    finally:
        rec.release()


def test_a_parametrization_registered_after_capture_is_noticed(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = MLP().to(device)
    rec = rk.capture(model, backend=backend)
    try:
        x = torch.randn(4, 6, device=device)
        for _ in range(2):
            model(x).sum().backward()
        torch.nn.utils.parametrizations.weight_norm(model.fc1)
        model(x).sum().backward()
        assert rec.retired or rec.counts["record"] >= 2 or rec.counts["eager"] >= 1
    finally:
        rec.release()


def test_a_lazy_module_is_refused_clearly_until_materialized() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(rk.ReplayError, match="lazy"):
        rk.capture(model, backend="emulated")
    model(torch.randn(3, 5))  # materializes
    rk.capture(model, backend="emulated").release()
