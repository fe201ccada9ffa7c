"""Host-side values a graph freezes: submodules' modes, BN momentum, dropout p, float and flag attributes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards.pattern import MLP

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("host_values"))
def test_host_values_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("host_values"))
def test_without_the_guard_host_values_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "bn_eval": lambda m: m.bn.eval(),
    "dropout_eval": lambda m: m.drop.eval(),
    "bn_momentum": lambda m: setattr(m.bn, "momentum", 0.5),
    "bn_momentum_none": lambda m: setattr(m.bn, "momentum", None),
    "dropout_p": lambda m: setattr(m.drop, "p", 0.1),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_host_value_is_not_replayed_from_the_old_recording(
    backend: str, device: str, change: str
) -> None:
    """After the change the next call re-records or routes eager (with a reason): it is no plain replay."""
    torch.manual_seed(0)
    model = MLP(bn=True, p=0.3).to(device)
    rec = rk.capture(model, backend=backend)
    try:
        x = torch.randn(4, 6, device=device)
        for _ in range(2):
            model(x).sum().backward()
        assert rec.counts["replay"] == 1
        CHANGES[change](model)
        model(x).sum().backward()
        assert rec.counts["replay"] == 1, rec.journal.format()
        assert rec.counts["record"] == 2 or rec.counts["eager"] >= 1 or rec.retired
    finally:
        rec.release()
