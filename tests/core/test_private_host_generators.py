"""A private host generator (``random.Random``, numpy's ``Generator`` / ``RandomState``) the model
holds, its forward names or loss_fn holds: every call ends as the plain eager loop's, the
generator's state included.

The recording call runs the step's Python more than once (probe, reference, capture), each run
drawing from the generator. The call state puts it back (``call_state``), and a run that drew
from one retires the entry point, naming it (``host_rng``): a replay would repeat the draw.
Under ``rk.capture`` the probe draws first, so without the put-back the eager run that follows
draws a shifted stream. Under ``rk.TrainStep`` the reference run is the call's first and stands
when it drew, so there the detection is what keeps it exact: without it the step records and
replays the first draw.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

CALLS = 5
KINDS = ["random", "numpy", "randomstate"]


def _generator(kind: str) -> Any:
    if kind == "random":
        return random.Random(7)
    if kind == "numpy":
        return np.random.default_rng(7)
    return np.random.RandomState(7)


def _draws(rng: Any, n: int = 6) -> list[float]:
    if isinstance(rng, random.Random):
        return [rng.random() for _ in range(n)]
    return [float(v) for v in rng.random(n)]


def _state(rng: Any) -> Any:
    """The generator's state, comparable with ``==``."""
    if isinstance(rng, random.Random):
        return rng.getstate()
    if isinstance(rng, np.random.RandomState):
        _, key, pos, has_gauss, gauss = rng.get_state()
        return key.tobytes(), pos, has_gauss, gauss
    return rng.bit_generator.state


class Masked(nn.Module):
    """MAE-style masking: a feature mask drawn from ``self.rng`` in forward."""

    def __init__(self, rng: Any) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.tensor([float(d > 0.3) for d in _draws(self.rng)], device=x.device)
        return self.net(x * mask)


_RNG: Any = None  # the generator GlobalMasked's forward names


class GlobalMasked(Masked):
    """The same mask drawn from a module-level generator its forward names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.tensor([float(d > 0.3) for d in _draws(_RNG)], device=x.device)
        return self.net(x * mask)


def _capture_run(
    where: str, kind: str, device: str, backend: str | None, unsafe: tuple[str, ...] = ()
) -> tuple[list, Any, Any]:
    """CALLS steps of a plain loop, captured unless ``backend`` is None: the losses, gradients
    and weights, the generator's state, the recorder."""
    global _RNG
    torch.manual_seed(0)
    rng = _generator(kind)
    _RNG = rng if where == "global" else None
    model = (Masked(rng) if where == "module" else GlobalMasked(None)).to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(CALLS):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(4, 6, generator=g).to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    end = [*losses, *(p.grad for p in model.parameters()), *model.parameters()]
    return end, _state(rng), rec


def _same(a: list, b: list) -> bool:
    return all(
        (x is None) == (y is None) and (x is None or torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["module", "global"])
def test_a_captured_forward_drawing_from_a_private_generator_ends_as_eager(
    backend: str, device: str, where: str, kind: str
) -> None:
    eager, eager_rng, _ = _capture_run(where, kind, device, None)
    replayed, rng, rec = _capture_run(where, kind, device, backend)
    assert _same(eager, replayed)
    assert rng == eager_rng
    assert rec.retired and "private host generator" in rec.retire_reason, rec.summary()
    if where == "module":
        assert "Masked.rng" in rec.retire_reason


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["module", "global"])
def test_without_the_call_state_the_probe_shifts_the_generator(
    backend: str, device: str, where: str, kind: str
) -> None:
    eager, eager_rng, _ = _capture_run(where, kind, device, None)
    replayed, rng, _ = _capture_run(where, kind, device, backend, negative_control("call_state"))
    assert rng != eager_rng
    assert not _same(eager, replayed)


def _closure_loss(rng: Any) -> Callable[..., torch.Tensor]:
    """A task choice drawn from a generator the loss closes over."""

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return out.pow(2).mean() if _draws(rng, 1)[0] < 0.5 else out.abs().mean()

    return loss_fn


class _Sampler:
    """A loss object whose bound method draws from the generator it holds."""

    def __init__(self, rng: Any) -> None:
        self.rng = rng

    def loss(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = torch.tensor(_draws(self.rng, 3), device=x.device)
        return F.mse_loss(m(x), torch.zeros_like(x[:, :3]) + w)


def _plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def _step_world(where: str, kind: str, device: str) -> tuple[nn.Module, Callable, Any]:
    torch.manual_seed(0)
    rng = _generator(kind)
    if where == "module":
        return Masked(rng).to(device), _plain, rng
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    loss_fn = _closure_loss(rng) if where == "closure" else _Sampler(rng).loss
    return model, loss_fn, rng


def _step_run(
    where: str, kind: str, device: str, backend: str | None, unsafe: tuple[str, ...] = ()
) -> tuple[list, Any, Any]:
    """CALLS steps through ``rk.TrainStep``, or (``backend`` None) the plain eager loop."""
    model, loss_fn, rng = _step_world(where, kind, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = None
    if backend is not None:
        step = rk.TrainStep(model, loss_fn, opt, backend=backend, unsafe_disable=unsafe)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(CALLS):
        x = torch.randn(4, 6, generator=g).to(device)
        if step is not None:
            losses.append(step(x))
            continue
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    end = [*losses, *(p.grad for p in model.parameters()), *model.parameters()]
    return end, _state(rng), step


STEP_CASES = [
    ("module", "random"),
    ("module", "numpy"),
    ("closure", "random"),
    ("closure", "numpy"),
    ("bound", "random"),
]


@pytest.mark.parametrize(("where", "kind"), STEP_CASES)
def test_a_step_drawing_from_a_private_generator_ends_as_eager(
    backend: str, device: str, where: str, kind: str
) -> None:
    eager, eager_rng, _ = _step_run(where, kind, device, None)
    replayed, rng, step = _step_run(where, kind, device, backend)
    assert _same(eager, replayed)
    assert rng == eager_rng
    assert step.retired and "private host generator" in step.retire_reason, step.summary()


#: what else sees a numpy Generator move (its key holds its state): switched off with the draw's watch
_ALSO = {
    ("module", "numpy"): ("side_effects", "module_state"),
    ("closure", "numpy"): ("loss_inputs",),
}


@pytest.mark.parametrize(("where", "kind"), STEP_CASES)
def test_without_the_draw_watch_a_step_replays_the_first_draw(
    backend: str, device: str, where: str, kind: str
) -> None:
    if backend == "cuda" and where != "closure":
        pytest.skip(
            "the mask drawn on the host is copied to the GPU inside the model: without the watch "
            "the capture meets that copy of a host-computed tensor and retires, exact (H200)"
        )
    eager, eager_rng, _ = _step_run(where, kind, device, None)
    unsafe = negative_control("host_rng", *_ALSO.get((where, kind), ()))
    replayed, rng, step = _step_run(where, kind, device, backend, unsafe)
    assert step.counts["replay"] > 0
    assert rng != eager_rng
    assert not _same(eager, replayed)
