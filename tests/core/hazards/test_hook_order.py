"""Gradient hooks on parameters fire in eager's order (or the recorder routes eager / retires, with a reason).

Hooks present at the first record are refused by the probe (``record_probe``); hooks registered
later are seen by the guards' hook watcher (``param_identity``). Each pattern's unsafe arm diverges.
"""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing.hazards.pattern import MLP

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("hook_order"))
def test_hook_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("hook_order"))
def test_without_the_guard_hook_order_diverges(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


@pytest.mark.parametrize("kind", ["post_accumulate", "tensor"])
def test_each_parameter_hook_fires_once_per_backward_in_eager_order(
    backend: str, device: str, kind: str
) -> None:
    torch.manual_seed(0)
    model, twin = MLP(bn=True).to(device), MLP(bn=True).to(device)
    twin.load_state_dict(model.state_dict())
    rec = rk.capture(model, backend=backend)
    orders: dict[int, list[int]] = {id(model): [], id(twin): []}
    try:
        for m in (model, twin):
            for i, p in enumerate(m.parameters()):
                log = orders[id(m)]
                if kind == "post_accumulate":
                    p.register_post_accumulate_grad_hook(lambda _p, i=i, log=log: log.append(i))
                else:
                    p.register_hook(lambda g, i=i, log=log: log.append(i))
        for _ in range(3):
            x = torch.randn(4, 6, device=device)
            for m in (model, twin):
                m(x).pow(2).mean().backward()
        assert orders[id(model)] == orders[id(twin)], rec.journal.format()
    finally:
        rec.release()
