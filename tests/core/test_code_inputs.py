"""What a whole step's ``loss_fn`` reads when it is a method of the module that holds the model
(a LightningModule's ``compute_loss``): the attributes and properties its code names key the
recording, and the framework state beside them (cycles, logs that grow) neither hides them
nor changes the key every call."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards import MLP


class Holder(nn.Module):
    """Holds the model and a run whose step count a property exposes (Lightning's global_step)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.run = type("Run", (), {})()
        self.run.holder, self.run.steps, self.run.log = self, 0, []  # a cycle, a growing log

    @property
    def stage(self) -> int:
        return min(self.run.steps, 3) // 3  # 0 for three steps, then 1

    def scale(self) -> float:
        return 0.5 + self.stage

    def compute_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x).pow(2).mean() * self.scale()


def _train(replay: bool, disable: tuple[str, ...] = ()) -> tuple[Holder, rk.TrainStep, list]:
    torch.manual_seed(0)
    holder = Holder()
    opt = torch.optim.SGD(holder.net.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", rk.ReplayWarning)
        step = rk.TrainStep(
            holder.net,
            holder.compute_loss,
            opt,
            replay=replay,
            backend="emulated",
            unsafe_disable=disable,
        )
    torch.manual_seed(1)
    for _ in range(7):
        loss = step(torch.randn(4, 6))
        holder.run.steps += 1
        holder.run.log.append(float(loss))
    return holder, step, [str(w.message) for w in said]


def _same(a: Holder, b: Holder) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_a_property_read_through_a_helper_method_keys_the_recording() -> None:
    twin, _, _ = _train(False)
    mine, step, said = _train(True)
    assert not said  # nothing unwatched: the cycle and the log are not read by the loss
    assert step.counts["replay"] >= 3 and step.counts["record"] == 2, step.journal
    assert _same(twin, mine)


def test_without_loss_inputs_the_stage_change_is_frozen() -> None:
    twin, _, _ = _train(False)
    unsafe, _, _ = _train(True, ("loss_inputs",))
    assert not _same(twin, unsafe)
