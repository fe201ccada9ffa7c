"""A GAN's generator step through a trainable discriminator whose loss the loop still holds.

The discriminator's loss keeps its parameters' gradient accumulators (made by its eager step, on
CUDA on the default stream, which a capture's backward could not wait on): the step's capture
puts stand-ins on the same memory in their place (``memory/foreign.py``). A weight tied under two
names keeps its place: one stand-in would take only one name's share of the gradient (the
recording call's verification would catch it, and every call run eagerly).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk

from ._same import same


class Disc(nn.Module):
    """A small critic; ``tied``: its two hidden layers share one weight."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        if tied:
            self.fc3.weight = self.fc2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))))


def _run(
    replay: bool,
    backend: str,
    tied: bool,
    fresh: bool,
    before: Callable[[Disc, int], None] | None = None,
    critic: type[Disc] | None = None,
) -> tuple[list, rk.TrainStep]:
    """Six alternating steps; per step the parameters of both nets and the critic's gradients.
    ``fresh``: the critic's gradients are set to None before the generator step (the generator
    step makes them anew), else it adds to its own step's. ``before(disc, i)``: at each step's
    start (what a loop does to the critic)."""
    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).to(device)
    disc = (critic or Disc)(tied).to(device)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9)

    def g_loss(g: nn.Module, z: torch.Tensor) -> torch.Tensor:
        return -disc(g(z)).mean()

    step = rk.TrainStep(gen, g_loss, g_opt, backend=backend, replay=replay)
    torch.manual_seed(1)
    seen = []
    for i in range(6):
        if before is not None:
            before(disc, i)
        real, z = torch.randn(4, 6, device=device) + 1.0, torch.randn(4, 6, device=device)
        d_opt.zero_grad(set_to_none=True)
        d_loss = disc(gen(z).detach()).mean() - disc(real).mean()
        d_loss.backward()  # d_loss stays alive through the generator step, as in most GAN loops
        d_opt.step()
        if fresh:
            d_opt.zero_grad(set_to_none=True)
        step(torch.randn(4, 6, device=device))
        seen.append(
            [p.detach().clone() for p in (*gen.parameters(), *disc.parameters())]
            + [None if p.grad is None else p.grad.clone() for p in disc.parameters()]
        )
    return seen, step


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_gan_step_keeping_the_critic_loss_replays_like_eager(
    backend: str, tied: bool, fresh: bool
) -> None:
    eager, _ = _run(False, backend, tied, fresh)
    seen, step = _run(True, backend, tied, fresh)
    assert same(seen, eager)
    if tied and backend == "cuda":
        return  # the tied weight keeps its place and its default-stream accumulator: may retire
    # a tied weight given a stand-in under one name: the recording call's verification finds the
    # gradient differs and every call runs eagerly (exact, but nothing replays)
    assert step.counts["replay"] >= 3, step.journal.format()


def _clip_data(disc: Disc, i: int) -> None:
    """WGAN's weight clipping as many implementations write it: each weight's ``.data`` re-bound."""
    for p in disc.parameters():
        p.data = p.data.clamp(-0.3, 0.3) * (0.9 if i == 3 else 1.0)


def _rebind_once(disc: Disc, i: int) -> None:
    if i == 3:
        disc.out.weight.data = disc.out.weight.data * 0.5


def _gain(disc: Disc, i: int) -> None:
    """An attribute on a weight that the critic's forward reads (an equalised-lr gain)."""
    if i == 0:
        disc.out.weight.gain = 0.5


class GainDisc(Disc):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))
        return torch.nn.functional.linear(h, self.out.weight * self.out.weight.gain, self.out.bias)


@pytest.mark.parametrize("before", [_clip_data, _rebind_once], ids=["every_step", "once"])
def test_a_critic_weight_re_bound_is_read_where_it_is_now(backend: str, before: Callable) -> None:
    """A recording reads the memory it was captured on: a critic weight's ``.data`` re-bound keys
    a new recording (every step's clipping records anew each call: exact, eager past the budget)."""
    eager, _ = _run(False, backend, False, False, before)
    seen, step = _run(True, backend, False, False, before)
    assert same(seen, eager), step.journal.format()
    if before is _rebind_once:
        assert step.counts["replay"] >= 2, step.journal.format()


def test_a_critic_weight_keeps_its_attributes_in_the_capture(backend: str) -> None:
    """A stand-in carries the attributes set on the weight it stands in for."""
    eager, _ = _run(False, backend, False, False, _gain, GainDisc)
    seen, step = _run(True, backend, False, False, _gain, GainDisc)
    assert same(seen, eager)
    assert step.counts["replay"] >= 3, step.journal.format()


def _two_critics(replay: bool, backend: str) -> tuple[list, rk.TrainStep]:
    """Two critics held apart that share one weight (a shared feature layer), both trained."""
    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).to(device)
    first, second = Disc(False).to(device), Disc(False).to(device)
    second.fc1.weight = first.fc1.weight
    critics = [*first.parameters(), *(p for p in second.parameters() if p is not first.fc1.weight)]
    d_opt = torch.optim.SGD(critics, lr=0.05)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.05)

    def g_loss(g: nn.Module, z: torch.Tensor) -> torch.Tensor:
        fake = g(z)
        return -(first(fake).mean() + second(fake).mean())

    step = rk.TrainStep(gen, g_loss, g_opt, backend=backend, replay=replay)
    torch.manual_seed(1)
    seen = []
    for _ in range(6):
        d_opt.zero_grad(set_to_none=True)
        fake = gen(torch.randn(4, 6, device=device)).detach()
        d_loss = first(fake).mean() + second(fake).mean()
        d_loss.backward()
        d_opt.step()
        d_opt.zero_grad(set_to_none=True)  # the generator step makes the critics' gradients anew
        step(torch.randn(4, 6, device=device))
        seen.append([p.detach().clone() for p in (*gen.parameters(), *critics)])
        seen.append([None if p.grad is None else p.grad.clone() for p in critics])
    return seen, step


def test_a_weight_two_critics_share_keeps_its_place(backend: str) -> None:
    eager, _ = _two_critics(False, backend)
    seen, step = _two_critics(True, backend)
    assert same(seen, eager)
    if backend != "cuda":
        assert step.counts["replay"] >= 3, step.journal.format()
