"""A module's own torch.Generator under ``rk.capture``: registered with the recording, drawn from
at each replay as eager draws from it (a CUDA graph's ``register_generator_state``; the tape's
live draw). A generator the module does not hold still retires; one assigned anew records anew."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

_GLOBAL = torch.Generator().manual_seed(5)


class Noisy(nn.Module):
    """Feature noise from a generator: the module's own, or a module-level one (``held=False``)."""

    def __init__(self, device: str, held: bool = True) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.gen = torch.Generator(device=device).manual_seed(7) if held else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gen = self.gen if self.gen is not None else _GLOBAL
        return self.net(x + 0.1 * torch.randn(x.shape, generator=gen, device=x.device))


def _train(device: str, backend: str | None, epochs: str = "", unsafe=(), **kw) -> tuple:
    """Six steps as a user writes them (captured unless ``backend`` is None). ``epochs``: every
    other step the generator is ``"reseeded"`` in place or ``"replaced"`` by a new one."""
    torch.manual_seed(0)
    model = Noisy(device, **kw).to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        if epochs == "reseeded" and step % 2 == 0:
            model.gen.manual_seed(100 + step)
        elif epochs == "replaced" and step % 2 == 0:
            model.gen = torch.Generator(device=device).manual_seed(100 + step)
        opt.zero_grad(set_to_none=True)
        model(torch.randn(3, 4, device=device)).pow(2).mean().backward()
        opt.step()
    gen = model.gen if model.gen is not None else _GLOBAL
    return [*model.parameters(), gen.get_state()], rec


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("epochs", ["", "reseeded", "replaced"])
def test_the_modules_own_generator_replays_like_eager(
    backend: str, device: str, epochs: str
) -> None:
    eager, _ = _train(device, None, epochs)
    replayed, rec = _train(device, backend, epochs)
    assert _same(eager, replayed)  # the parameters, and the generator where eager leaves it
    assert rec.counts["replay"] > 0 and not rec.retired, rec.summary()


def test_without_the_module_guard_a_replaced_generator_replays_the_old_one(
    backend: str, device: str
) -> None:
    eager, _ = _train(device, None, "replaced")
    replayed, rec = _train(device, backend, "replaced", negative_control("module_state"))
    assert rec.counts["replay"] > 0
    assert not _same(eager, replayed)


def test_a_generator_the_module_does_not_hold_retires() -> None:
    """A module-level generator: the recording call's extra runs could not put it back."""
    _GLOBAL.manual_seed(5)
    eager, _ = _train("cpu", None, held=False)
    _GLOBAL.manual_seed(5)
    replayed, rec = _train("cpu", "emulated", held=False)
    assert _same(eager, replayed)
    assert rec.retired and "private torch.Generator" in rec.retire_reason
