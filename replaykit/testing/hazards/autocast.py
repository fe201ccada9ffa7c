"""A parameter used several times under autocast (found by the model zoo).

Autocast caches the low-precision cast of a leaf that requires grad for the rest of the
autocast region, so eager casts each parameter once per region: every use shares one
cast, and the autograd engine sums their gradients in the low precision before the cast
back to float32. A recording cannot share autocast's cache (a cast cached during capture
would outlive it), so it casts per use and sums the gradients in float32: other bits.
Torchvision's RetinaNet head (one set of convs over five FPN levels) showed it under
16-mixed and bf16-mixed.

Within one call the probe counts the casts and routes that signature eager
(``autocast_shared_weight``). Two calls of one captured module inside one autocast region
whose outputs meet in one backward share eager's cast across the calls: a recording made
under autocast is first used eagerly and watched (``replaykit.memory.reentry``); the second call
arriving before that call's backward routes the signature eager (``autocast_shared_region``),
exact from the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, loss_steps, sgd, step_loop
from .writing import HazardClass, built

HAZARD = "autocast"
HC = HazardClass(HAZARD)


class SharedHead(nn.Module):
    """One head applied to several feature maps (a detection head over FPN levels)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        return torch.cat([self.head(h), self.head(h.flip(0) * 0.5), self.head(h.roll(1, 0) * 0.25)])


class OneHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _autocast_loop(model: nn.Module, arm: Arm, calls: int, steps: int = 4) -> Extras:
    """bf16 autocast (CPU and CUDA both have it); ``calls`` forwards in one region, one backward."""
    opt = sgd(model)
    kept: Extras = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(arm.device).type, dtype=torch.bfloat16):
            loss = sum((k + 1) * model(arm.randn(4, 6)).float().pow(2).mean() for k in range(calls))
        loss.backward()
        opt.step()
        kept[f"loss{step}"] = loss.detach()
    return kept


PATTERNS: list[Pattern] = [
    HC.pattern(
        "autocast_shared_weight",
        "a head applied three times in one forward under bf16 autocast",
        built(SharedHead),
        lambda m, a: _autocast_loop(m, a, calls=1),
        guard="record_probe",
    ),
    Pattern(
        "step_autocast_shared_weight",
        "autocast",
        "a head applied three times in one forward, whole step under bf16-mixed",
        lambda d: SharedHead().to(d),
        lambda m, a: step_loop(m, a, steps=5, precision="bf16-mixed"),
        api="step",  # one graph runs the region as eager does (cast cache on): no guard needed
    ),
    HC.pattern(
        "step_autocast_two_calls_one_region",
        "loss_fn calls the model twice in one bf16-mixed region, one backward, whole step",
        built(OneHead),
        lambda m, a: step_loop(
            m,
            a,
            loss_fn=lambda m, x: (m(x) + m(x * 0.5)).pow(2).mean(),
            steps=5,
            precision="bf16-mixed",
        ),
        api="step",
    ),
    HC.pattern(
        "autocast_two_calls_one_region",
        "two calls of one captured module in one bf16 autocast region, one backward",
        built(OneHead),
        lambda m, a: _autocast_loop(m, a, calls=2),
        guard="reentry",
    ),
]


def _one_region_for_the_loop(model: nn.Module, arm: Arm) -> Extras:
    """Every step, optimizer included, inside one autocast region: eager casts each weight once, at
    the first step, and reuses that cast until the region ends (the weights it trains move on)."""
    with torch.autocast(torch.device(arm.device).type, dtype=torch.bfloat16):
        return loss_steps(model, arm, lambda m, a: m(a.randn(4, 6)).float().pow(2).mean())


KNOWN_LIMITS: list[Pattern] = [
    HC.pattern(
        "autocast_region_spans_the_loop",
        "the whole training loop inside one bf16 autocast region (eager reuses step 1's casts)",
        built(nn.Linear, 6, 3),
        _one_region_for_the_loop,
    ),
]
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
