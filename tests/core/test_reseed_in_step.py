"""Seeding torch's generator inside the recorded code (emulated backend).

A CUDA capture refuses a reseed of the generator it draws from, and a replay runs no Python, so it
would not reseed where eager does at every call. The emulated backend fails the recording the
same way: by name (``torch.manual_seed``, ``torch.seed``, ``torch.cuda.manual_seed_all``, a
same-seed reseed included: ``backends.seeding.SeedingRefused``) and, past the names, when the tape finds a
generator moved since its last draw, read or set (``torch.default_generator.manual_seed``,
``.set_state``). The entry point retires with the reason and every call stays bitwise eager's;
what moves no generator past the tape still replays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.random import manual_seed as bound_manual_seed
from torch.utils.checkpoint import checkpoint

import replaykit as rk

from ._same import same

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
_FIXED: list[torch.Tensor] = []  # a generator state made before the loop (set_state's target)


def _mse(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((m(x) - y) ** 2).mean()


def _manual_seed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1234)  # "deterministic" dropout per step
    return _mse(m, x, y)


def _random_manual_seed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.random.manual_seed(1234)
    return _mse(m, x, y)


def _bound_manual_seed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    bound_manual_seed(1234)  # bound at import: reaches torch.cuda.manual_seed_all
    return _mse(m, x, y)


def _cuda_manual_seed_all(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.cuda.manual_seed_all(3)  # the device generator a graph draws from
    return _mse(m, x, y)


def _fork_rng_noise(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        noise = 0.1 * torch.randn_like(x)
    return _mse(m, x + noise, y)


def _generator_manual_seed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.default_generator.manual_seed(3)  # past the names: the generator is found moved
    return _mse(m, x, y)


def _fork_rng_generator_seed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.default_generator.manual_seed(0)
        noise = 0.1 * torch.randn_like(x)
    return _mse(m, x + noise, y)


def _generator_set_state(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.default_generator.set_state(_FIXED[0])
    return _mse(m, x, y)


def _seed_after_draws(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = _mse(m, x, y)
    torch.default_generator.manual_seed(11)  # no draw after it in the step: found at the end
    return loss


def _swallowed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with contextlib.suppress(RuntimeError):  # the refusal hidden: the recording fails at its end
        torch.manual_seed(9)
    return _mse(m, x, y)


RESEEDS: dict[str, tuple[Loss, str]] = {
    "manual_seed": (_manual_seed, "torch.manual_seed(1234) seeds torch's generator"),
    "random_manual_seed": (_random_manual_seed, "torch.random.manual_seed(1234) seeds"),
    "bound_manual_seed": (_bound_manual_seed, "torch.cuda.manual_seed_all(1234) seeds"),
    "cuda_manual_seed_all": (_cuda_manual_seed_all, "torch.cuda.manual_seed_all(3) seeds"),
    "fork_rng_noise": (_fork_rng_noise, "torch.manual_seed(0) seeds torch's generator"),
    "generator_manual_seed": (_generator_manual_seed, "default generator was seeded or set"),
    "fork_rng_generator_seed": (_fork_rng_generator_seed, "default generator was seeded or set"),
    "generator_set_state": (_generator_set_state, "default generator was seeded or set"),
    "seed_after_draws": (_seed_after_draws, "found before the end of the recorded code"),
    "swallowed": (_swallowed, "torch.manual_seed(9) seeds torch's generator"),
}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))


def _step_run(loss_fn: Loss, replay: bool, steps: int = 6) -> tuple[list[Any], rk.TrainStep]:
    """``steps`` TrainStep calls; what eager and a replay must agree on: losses, parameters, the
    gradients (None where eager leaves None) and where the default generator ends."""
    torch.manual_seed(0)
    _FIXED[:] = [torch.default_generator.get_state()]
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(model, loss_fn, opt, backend="emulated", replay=replay)
    torch.manual_seed(7)
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        losses.append(step(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)))
    params = list(model.parameters())
    kept = [losses, [p.detach() for p in params], [p.grad for p in params]]
    return [*kept, torch.default_generator.get_state()], step


@pytest.mark.parametrize("case", list(RESEEDS))
def test_a_reseed_in_the_step_retires_and_every_call_is_eagers(case: str) -> None:
    loss_fn, reason = RESEEDS[case]
    eager, _ = _step_run(loss_fn, replay=False)
    replayed, step = _step_run(loss_fn, replay=True)
    assert same(replayed, eager), step.journal.format()
    assert step.retired and step.retire_reason.startswith("capture failed: ReplayError:")
    assert reason in step.retire_reason, step.retire_reason
    assert step.counts["replay"] == 0 and step.eager_reasons["retired"] > 0, step.summary()


def test_torch_seed_in_the_step_retires() -> None:
    """``torch.seed()`` picks a nondeterministic seed: no eager twin to compare, the route only."""

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch.seed()
        return _mse(m, x, y)

    _, step = _step_run(loss_fn, replay=True, steps=4)
    assert step.retired and "torch.seed() seeds torch's generator" in step.retire_reason
    assert step.counts["replay"] == 0, step.summary()


def _fork_rng_no_seed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():  # the same draws every call: get and set are on the tape
        noise = 0.1 * torch.randn_like(x)
    return _mse(m, x + noise, y)


def _random_get_set(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    state = torch.random.get_rng_state()  # torch.random's names, taped like torch's
    noise = 0.1 * torch.randn_like(x)
    torch.random.set_rng_state(state)
    return _mse(m, x + noise, y)


def _checkpointed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((checkpoint(m, x, use_reentrant=False) - y) ** 2).mean()


@pytest.mark.parametrize("loss_fn", [_mse, _fork_rng_no_seed, _random_get_set, _checkpointed])
def test_what_moves_no_generator_past_the_tape_still_replays(loss_fn: Loss) -> None:
    eager, _ = _step_run(loss_fn, replay=False)
    replayed, step = _step_run(loss_fn, replay=True)
    assert same(replayed, eager), step.journal.format()
    assert not step.retired and step.counts["replay"] > 0, step.summary()


class _Seeded(nn.Module):
    """Reseeds in its forward: by name, through the default generator, or its own generator."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.net = _net()
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "manual_seed":
            torch.manual_seed(7)
        elif self.how == "generator":
            torch.default_generator.manual_seed(7)
        elif self.how == "own_generator":
            self.gen.manual_seed(1)
        keep = torch.rand(3, generator=self.gen) > 0.3  # its own (registered) generator
        return self.net(x) * keep


def _capture_run(how: str, captured: bool) -> tuple[list[Any], Any]:
    """Five training calls of a module seeded 7 just before (a reseed to the seed it has)."""
    torch.manual_seed(0)
    model = _Seeded(how)
    rec = rk.capture(model, backend="emulated") if captured else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(7)
    outs = []
    for i in range(5):
        out = model(torch.randn(5, 6, generator=torch.Generator().manual_seed(i)))
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    params = [p.detach() for p in model.parameters()]
    gens = [torch.default_generator.get_state(), model.gen.get_state()]
    return [outs, params, [p.grad for p in model.parameters()], gens], rec


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("manual_seed", "torch.manual_seed(7) seeds torch's generator"),
        ("generator", "torch's default generator was seeded or set"),
        ("own_generator", "the module's torch.Generator was seeded or set"),
    ],
)
def test_a_reseed_in_a_captured_forward_retires(how: str, reason: str) -> None:
    eager, _ = _capture_run(how, captured=False)
    replayed, rec = _capture_run(how, captured=True)
    assert same(replayed, eager), rec.journal.format()
    assert rec.retired and rec.retire_reason.startswith("capture failed: ReplayError:")
    assert reason in rec.retire_reason, rec.retire_reason
    assert rec.counts["replay"] == 0, rec.summary()


def test_a_captured_forward_that_seeds_nothing_replays() -> None:
    eager, _ = _capture_run("", captured=False)
    replayed, rec = _capture_run("", captured=True)
    assert same(replayed, eager), rec.journal.format()
    assert not rec.retired and rec.counts["replay"] > 0, rec.summary()


def test_the_seeding_names_are_put_back_after_a_failed_recording() -> None:
    names = [(torch, "manual_seed"), (torch.random, "manual_seed"), (torch, "seed")]
    names += [(torch.cuda, "manual_seed_all"), (torch, "get_rng_state")]
    names += [(torch.random, "set_rng_state")]
    before = [getattr(module, name) for module, name in names]
    _step_run(_manual_seed, replay=True, steps=3)
    assert [getattr(module, name) for module, name in names] == before
