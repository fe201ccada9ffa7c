"""``loss_fn`` returning more than the loss (``loss, logits``; ``{"loss": ...}``) is a clear
``ReplayError`` naming what it returned, not ``'tuple' object has no attribute 'backward'`` from
inside the step (hostile review), whether the call warms up, records or runs the eager twin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk


@pytest.mark.parametrize("warmup", [0, 1])
@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_a_loss_fn_returning_more_than_the_loss_is_said(
    kind: str, replay: bool, warmup: int
) -> None:
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor):
        out = m(x)
        loss = nn.functional.cross_entropy(out, y)
        return (loss, out) if kind == "tuple" else {"loss": loss}

    step = rk.TrainStep(net, loss_fn, opt, replay=replay, backend="emulated", warmup=warmup)
    with pytest.raises(rk.ReplayError, match=f"returned a {kind}"):
        step(torch.randn(5, 4), torch.randint(0, 3, (5,)))
