"""Draws from Python's ``random`` or numpy that only choose, under ``rk.capture`` (LayerDrop).

The recorder learns the draws at the first call (run eagerly), then draws them itself before
choosing a recording and keys by the comparisons' results: each branch pattern records once and
replays, and the generators end where eager's draws leave them. A drawn value that reaches the
computation is caught by the recording's verification and runs eagerly.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control


class LayerDrop(nn.Module):
    """Two residual blocks, each skipped when a host draw says so; ``source`` picks the generator;
    ``scaled``: the kept block is scaled by the drawn value (the value reaches the computation)."""

    def __init__(self, source: str = "random", scaled: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)
        self.source, self.scaled = source, scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            r = random.random() if self.source == "random" else np.random.rand()
            if r < 0.5:
                continue
            y = torch.relu(block(x))
            x = x + (y * r if self.scaled else y)
        return self.head(x)


def _train(
    device: str, backend: str | None, unsafe: tuple[str, ...] = (), check_every: int = 0, **kw
) -> tuple:
    """Eight steps as a user writes them, captured unless ``backend`` is None; the end state,
    the host generators' states and the recorder."""
    torch.manual_seed(0)
    random.seed(3)
    np.random.seed(3)
    model = LayerDrop(**kw).to(device)
    recorder = None
    if backend is not None:
        recorder = rk.capture(
            model, backend=backend, unsafe_disable=unsafe, check_every=check_every
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(8):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(3, 4, device=device)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    state = [*model.parameters(), *losses]
    return state, (random.getstate(), np.random.get_state()[1].tobytes()), recorder


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_layerdrop_drawn_on_the_host_replays_like_eager(
    backend: str, device: str, source: str
) -> None:
    eager, eager_rng, _ = _train(device, None, source=source)
    replayed, rng, recorder = _train(device, backend, source=source)
    assert _same(eager, replayed)
    assert rng == eager_rng  # the generators where eager's draws leave them
    assert recorder.counts["replay"] > 0
    assert not recorder.retired
    assert recorder.eager_reasons == {"host_choices": 1}  # the first call learns the draws


def test_without_host_choices_layerdrop_replays_the_recorded_branch(
    backend: str, device: str
) -> None:
    eager, _, _ = _train(device, None)
    replayed, _, recorder = _train(device, backend, negative_control("host_choices"))
    assert recorder.counts["replay"] > 0
    assert not _same(eager, replayed)


def test_a_drawn_value_reaching_the_computation_runs_eagerly(backend: str, device: str) -> None:
    """``y * r`` reads the draw in C++, unseen: the capture's draws are moved within the interval
    their comparisons allow, so the recording's verification sees it and the key runs eagerly."""
    eager, eager_rng, _ = _train(device, None, scaled=True)
    replayed, rng, recorder = _train(device, backend, scaled=True)
    assert _same(eager, replayed)
    assert rng == eager_rng
    assert recorder.eager_reasons["diverged"] > 0


def test_a_checked_replay_compares_with_eager_drawing_the_same_numbers(
    backend: str, device: str
) -> None:
    """``check_every``: eager's forward, run beside the replay, draws from where the call found
    the generators (not where the recorder's own draws left them), and the call ends where eager's
    draws leave them."""
    eager, eager_rng, _ = _train(device, None)
    replayed, rng, recorder = _train(device, backend, check_every=1)
    assert _same(eager, replayed) and rng == eager_rng
    assert not recorder.retired, recorder.retire_reason
    assert recorder.counts["replay"] > 0


class TorchLayerDrop(LayerDrop):
    """transformers' LayerDrop (Whisper, BART, ...): ``torch.rand([])`` from torch's CPU
    generator, compared on the host; ``scaled``: the drawn value reaches the computation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            r = torch.rand([])
            if r < 0.5:
                continue
            y = torch.relu(block(x))
            x = x + (y * r.to(x.device) if self.scaled else y)
        return self.head(x)


def _train_torch_draws(device: str, backend: str | None, **kw) -> tuple:
    """Sixteen steps; the end state, where torch's CPU generator stands, and the recorder."""
    torch.manual_seed(0)
    model = TorchLayerDrop(scaled=kw.pop("scaled", False)).to(device)
    recorder = rk.capture(model, backend=backend, **kw) if backend is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(16):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(3, 4, generator=g).to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [*model.parameters(), *losses], torch.default_generator.get_state(), recorder


@pytest.mark.parametrize("arm", ["plain", "checked", "scaled"])
def test_a_cpu_generator_draw_beside_a_gpu_model_is_drawn_before_the_replay(
    backend: str, device: str, arm: str
) -> None:
    """Beside a GPU model torch's CPU generator is host state a CUDA graph never advances. A draw
    read on the host only is learnt over two eager calls (seen, then found by the probe), then
    drawn before each call chooses a recording, keyed by the branch, and the generator ends where
    eager's draws leave it (``check_every=1``: eager's check draws the same numbers). A draw
    reaching the computation retires. On the CPU backend the draw is the device's and its host
    read retires, as before."""
    kw = {"check_every": 1} if arm == "checked" else {"scaled": True} if arm == "scaled" else {}
    eager, eager_rng, _ = _train_torch_draws(device, None, scaled=arm == "scaled")
    replayed, rng, recorder = _train_torch_draws(device, backend, **kw)
    assert _same(eager, replayed) and torch.equal(rng, eager_rng), recorder.summary()
    if backend != "cuda" or arm == "scaled":
        assert recorder.retired and recorder.counts["replay"] == 0, recorder.summary()
        return
    # two eager calls learn; then one recording per branch pattern (two coins: at most four)
    assert not recorder.retired and recorder.counts["record"] <= 4, recorder.summary()
    assert recorder.counts["replay"] >= 10 and recorder.eager_reasons["host_draws"] == 2
