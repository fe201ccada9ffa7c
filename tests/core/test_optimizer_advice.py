"""The README's optimizer advice holds on a CPU (torch's own checks), not only on a GPU.

The advice: SGD with ``fused=True``; Adam/AdamW with ``fused=True, capturable=True``; a tensor ``lr``
with either. ``capturable=True`` without ``fused`` and ``foreach=True`` with a tensor lr are CUDA-only.
"""

from __future__ import annotations

import pytest
import torch

import replaykit as rk

ADVISED = {
    "SGD fused, tensor lr": lambda p: torch.optim.SGD(
        p, lr=torch.tensor(0.1), momentum=0.9, fused=True
    ),
    "AdamW fused capturable, tensor lr": lambda p: torch.optim.AdamW(
        p, lr=torch.tensor(1e-3), fused=True, capturable=True
    ),
    "Adam fused capturable": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True, capturable=True),
}


@pytest.mark.parametrize("name", list(ADVISED))
def test_advised_optimizers_replay_bitwise_on_the_cpu(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())

    def loss(m, x):
        return m(x).square().mean()

    step = rk.TrainStep(model, loss, ADVISED[name](model.parameters()), backend="emulated")
    eager = rk.TrainStep(twin, loss, ADVISED[name](twin.parameters()), replay=False)
    for _ in range(5):
        x = torch.randn(4, 8)
        step(x)
        eager(x)
    assert step.counts["replay"] >= 3, step.summary()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_capturable_without_fused_is_cuda_only():
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    with pytest.raises(AssertionError, match="capturable"):
        torch.optim.AdamW([param], lr=1e-3, capturable=True).step()


def test_foreach_with_a_tensor_lr_needs_capturable():
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    with pytest.raises(ValueError, match="lr as a Tensor"):
        torch.optim.AdamW([param], lr=torch.tensor(1e-3), foreach=True).step()
