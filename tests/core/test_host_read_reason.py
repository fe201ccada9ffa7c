"""A host read's retirement names the Python line that made it, and the fix where it is
torch.distributions' argument validation (on by default: ``Categorical(logits=...)`` checks its
logits with ``.all()``). A PPO or SAC loss retired with "reads a tensor's value on the host
(.item(), ...)" though the user wrote no ``.item()`` (hostile review)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import replaykit as rk


def _policy_loss(m: nn.Module, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    d = torch.distributions.Categorical(logits=m(obs))
    return -d.log_prob(act).mean() - 0.01 * d.entropy().mean()


def _run(validate: bool) -> rk.TrainStep:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = rk.TrainStep(net, _policy_loss, opt, backend="emulated")
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(validate)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rk.ReplayWarning)
            for _ in range(4):
                step(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)
    return step


def test_distributions_validation_is_named_with_its_fix() -> None:
    step = _run(validate=True)
    assert step.retired
    assert "torch/distributions/" in step.retire_reason
    assert "validate_args=False" in step.retire_reason
    assert _run(validate=False).counts["replay"] >= 2  # the fix it names replays


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y[y > 0].sum()


def test_a_host_read_in_forward_names_its_line() -> None:
    net = Masked()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.ReplayWarning)
        with rk.capture(net, backend="emulated") as rec:
            for _ in range(2):
                net(torch.randn(8, 6)).backward()
            assert rec.retired
            assert "test_host_read_reason.py" in rec.retire_reason
            assert "in forward" in rec.retire_reason
