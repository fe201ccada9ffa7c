"""A user's class attributes that the code reaches through what it holds key the recordings.

``cfg.temperature`` falls back to ``Config.temperature`` while the instance has no value of its
own, and ``self.cfg = Config`` (config-as-class) holds the class itself: a script that sets
``Config.temperature = 4.0`` writes neither the instance nor the module. Likewise a helper module
imported inside the function that defines ``loss_fn`` (a closure cell, not a global). Each was
replayed with the old value, silently (hostile review); each switched-off arm must diverge.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control


class Config:
    temperature = 1.0


class Net(nn.Module):
    """Logits over a temperature read from a held config object or class."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.body = nn.Linear(6, 3)
        self.how = how
        self.cfg = Config() if how == "object" else Config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) / self.cfg.temperature


def _ce(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(m(x), y)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(6)
    ]


def _forward_run(how: str, entry: str, replay: bool, disable: tuple[str, ...] = ()):
    Config.temperature = 1.0
    torch.manual_seed(0)
    net = Net(how)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    counts: dict = {}
    if entry == "step":
        step = rk.TrainStep(
            net, _ce, opt, replay=replay, backend="emulated", unsafe_disable=disable
        )
        for i, (x, y) in enumerate(_data()):
            if i == 3:
                Config.temperature = 4.0
            step(x, y)
        counts = step.counts
    else:
        rec = rk.capture(net, backend="emulated", unsafe_disable=disable) if replay else None
        for i, (x, y) in enumerate(_data()):
            if i == 3:
                Config.temperature = 4.0
            _ce(net, x, y).backward()
            opt.step()
            opt.zero_grad()
        if rec is not None:
            counts = rec.counts
            rec.release()
    Config.temperature = 1.0
    return [p.detach().clone() for p in net.parameters()], counts


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.filterwarnings("ignore::replaykit.ReplayWarning")
@pytest.mark.parametrize("entry", ["capture", "step"])
@pytest.mark.parametrize("how", ["object", "class"])
def test_a_class_attribute_read_through_a_held_config_records_anew(how: str, entry: str) -> None:
    eager, _ = _forward_run(how, entry, replay=False)
    replayed, counts = _forward_run(how, entry, replay=True)
    assert _equal(eager, replayed)
    assert counts["record"] == 2 and counts["replay"] >= 3
    unsafe, _ = _forward_run(how, entry, True, negative_control("forward_inputs"))
    assert not _equal(eager, unsafe)  # without the key the old temperature replays


class Focal(nn.Module):
    """A criterion whose focusing parameter is a class attribute, annealed by the script."""

    gamma = 2.0

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1)
        return (-((1 - logp.exp()) ** self.gamma) * logp).mean()


def _helpers() -> types.ModuleType:
    mod = types.ModuleType("user_losses")
    exec(
        "GAMMA = 2.0\n"
        "def focal(logits, y):\n"
        "    logp = logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1)\n"
        "    return (-((1 - logp.exp()) ** GAMMA) * logp).mean()\n",
        mod.__dict__,
    )
    return mod


def _loss_run(how: str, replay: bool, disable: tuple[str, ...] = ()):
    Focal.gamma = 2.0
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if how == "module_in_closure":
        helpers = _helpers()  # imported inside the function that builds the loss

        def loss_fn(m, x, y):
            return helpers.focal(m(x), y)

        def anneal() -> None:
            helpers.GAMMA = 0.5

    else:
        crit = Focal()

        def loss_fn(m, x, y):
            return crit(m(x), y)

        def anneal() -> None:
            Focal.gamma = 0.5

    step = rk.TrainStep(
        net, loss_fn, opt, replay=replay, backend="emulated", unsafe_disable=disable
    )
    for i, (x, y) in enumerate(_data()):
        if i == 3:
            anneal()
        step(x, y)
    Focal.gamma = 2.0
    return [p.detach().clone() for p in net.parameters()], step.counts


@pytest.mark.filterwarnings("ignore::replaykit.ReplayWarning")
@pytest.mark.parametrize("how", ["module_in_closure", "criterion_class_attribute"])
def test_what_loss_fn_reaches_through_a_closure_keys_the_recording(how: str) -> None:
    eager, _ = _loss_run(how, replay=False)
    replayed, counts = _loss_run(how, replay=True)
    assert _equal(eager, replayed)
    assert counts["record"] == 2 and counts["replay"] >= 3
    unsafe, _ = _loss_run(how, True, negative_control("loss_inputs"))
    assert not _equal(eager, unsafe)
