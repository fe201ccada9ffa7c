"""A parameter that requires grad but is not the optimizer's (a backbone left out of a probe's
optimizer) ends eager's step with its gradient: ``optimizer.zero_grad()`` zeroes only its own.
A replay hands that gradient out as eager leaves it (it left it None before), and copies it out
before the next replay overwrites it while the loop still holds it (protection ``copy_out``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

from ._same import same


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


def _run(replay: bool, backend: str, unsafe: tuple[str, ...] = (), accumulate: int = 1) -> tuple:
    """Per call: the backbone's gradient as the loop keeps it (a reference), the parameters."""
    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).to(device)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)  # the head only
    step = rk.TrainStep(
        model, _loss, opt, backend=backend, replay=replay, unsafe_disable=unsafe,
        accumulate=accumulate,
    )  # fmt: skip
    torch.manual_seed(1)
    batches = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(8)]
    kept, seen = [], []
    for x, y in batches:
        model.zero_grad()  # the backbone's gradient: this call's alone
        step(x.to(device), y.to(device))
        kept.append(model[0].weight.grad)
        seen.append([p.detach().clone() for p in model.parameters()])
    return kept, seen, step


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_parameter_outside_the_optimizer_keeps_its_gradient(
    backend: str, accumulate: int
) -> None:
    eager_kept, eager_seen, _ = _run(False, backend, accumulate=accumulate)
    kept, seen, step = _run(True, backend, accumulate=accumulate)
    assert same(seen, eager_seen)
    assert same(kept, eager_kept)
    assert step.counts["replay"] >= 2, step.summary()


def test_without_copy_out_the_kept_gradients_are_overwritten() -> None:
    eager_kept, _, _ = _run(False, "emulated")
    kept, _, step = _run(True, "emulated", negative_control("copy_out"))
    assert step.counts["replay"] >= 2, step.summary()
    assert not same(kept, eager_kept)


def _shared(replay: bool) -> tuple[list, rk.TrainStep, rk.TrainStep]:
    """Two steps share an encoder; B's optimizer trains only B's head (a probe), so B's call
    leaves the encoder's gradient, and A's next call accumulates into it before stepping."""
    torch.manual_seed(0)
    enc = nn.Linear(8, 8)
    a, b = (nn.Sequential(enc, nn.Tanh(), nn.Linear(8, k)) for k in (4, 2))

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y % m[2].out_features)

    sa = rk.TrainStep(
        a, loss, torch.optim.SGD(a.parameters(), lr=0.1), backend="emulated", replay=replay
    )
    sb = rk.TrainStep(
        b, loss, torch.optim.SGD(b[2].parameters(), lr=0.1), backend="emulated", replay=replay
    )
    torch.manual_seed(1)
    seen = []
    for i in range(10):
        (sa if i % 2 == 0 else sb)(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        seen.append(
            [enc.weight.grad, *(p.detach().clone() for p in (*a.parameters(), *b.parameters()))]
        )
    return seen, sa, sb


def test_a_step_reading_another_steps_handed_out_gradient_reads_its_memory() -> None:
    """A's recording reads the encoder gradient B handed out; B's copy-out, moving what A's
    recording held, left A reading a stale copy (hostile round 7). It reads B's static memory,
    and B, whose static gradient A's recording now holds, runs eagerly (``live_alias``): exact."""
    eager, _, _ = _shared(False)
    seen, sa, sb = _shared(True)
    assert same(seen, eager)
    assert sa.counts["record"] >= 2 and sb.eager_reasons["live_alias"] >= 1, (
        sa.summary(),
        sb.summary(),
    )
