"""A reference, view or ``.data`` of ``p.grad`` the caller keeps is the gradient eager's would be.

Eager's ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place and the next backward
accumulates into it; between a whole step's micro-batches ``.grad`` is one running sum. So
whatever the caller kept of ``.grad`` (a gradient-norm history, an optimizer's view) *is* the next
gradient: values and storage, at every step. Copy-out moves a held gradient with every holder of
its storage (``memory/copy_out.py``); on a torch without the storage swap it leaves such a
gradient in place and the call runs eagerly (``live_alias``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.protections import negative_control
from replaykit.testing.parity.step_trial import SmallNet, small_loss

KEEP: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ref": lambda g: g,
    "view": lambda g: g.view(-1),
    "data": lambda g: g.data,
}
STEPS = 5


def _way(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``move``: this torch's storage swap; ``eager``: as on a torch without it."""
    if way == "eager":
        monkeypatch.setattr(copy_out, "_swap", None)
    elif not copy_out.holders_move():
        pytest.skip("this torch cannot move a held storage")


def _net(device: str) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _batches(device: str, n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(8, 8, generator=g).to(device),
            torch.randint(0, 4, (8,), generator=g).to(device),
        )
        for _ in range(n)
    ]


Seen = list[tuple[torch.Tensor, bool, bool]]


def _look(kept: torch.Tensor | None, grad: torch.Tensor | None, seen: Seen) -> None:
    """What the kept tensor holds now, whether it shares ``.grad``'s memory, and whether it is it."""
    if kept is not None:
        same = grad is not None and kept.data_ptr() == grad.data_ptr()
        seen.append((kept.detach().clone().view(-1), same, kept is grad))


def _same(eager: Seen, replay: Seen) -> bool:
    return len(eager) == len(replay) and all(
        torch.equal(a, b) and sa == sb and ia == ib
        for (a, sa, ia), (b, sb, ib) in zip(eager, replay, strict=True)
    )


def _zero_in_place_loop(
    keep: str,
    device: str,
    backend: str | None,
    opt_step: dict | None = None,
    net: bool = True,
    **kw,
) -> tuple[Seen, list]:
    """``zero_grad(set_to_none=False)``, backward, the kept tensor read, then clip and step
    (``opt_step``: replayed by an ``OptimizerStep`` made with these arguments; ``net``: the
    network replayed too)."""
    torch.manual_seed(0)
    model = _net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    entries = [rk.capture(model, backend=backend, **kw)] if backend is not None and net else []
    if opt_step is not None:
        entries.append(rk.OptimizerStep(opt, backend=backend, **opt_step))
    params = list(model.parameters())

    def body() -> None:
        nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    seen: Seen = []
    kept = None
    for x, y in _batches(device):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        _look(kept, model[0].weight.grad, seen)
        if opt_step is not None:
            entries[-1](body, key=("norm", 0.5))
        else:
            body()
        kept = KEEP[keep](model[0].weight.grad)
    _look(kept, model[0].weight.grad, seen)
    return seen, entries


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_across_zero_grad_in_place_is_the_gradient_under_capture(
    backend: str, device: str, keep: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _way(way, monkeypatch)
    eager, _ = _zero_in_place_loop(keep, device, None)
    replay, (rec,) = _zero_in_place_loop(keep, device, backend)
    assert _same(eager, replay), rec.journal.format()
    if way == "move":  # they replay: the gradient moved with its holders once
        assert rec.counts["replay"] == STEPS - 1 and not rec.eager_reasons, rec.journal.format()
    elif keep != "ref":  # a holder the rebinding cannot reach: eager while it is held
        assert rec.eager_reasons["live_alias"] > 0, rec.journal.format()
    rec.release()


@pytest.mark.parametrize("keep", list(KEEP))
def test_without_copy_out_a_kept_grad_differs_under_capture(
    backend: str, device: str, keep: str
) -> None:
    eager, _ = _zero_in_place_loop(keep, device, None)
    with pytest.warns(rk.ReplayWarning):
        replay, (rec,) = _zero_in_place_loop(
            keep, device, backend, unsafe_disable=negative_control("copy_out")
        )
    assert rec.counts["replay"] > 0
    assert not _same(eager, replay)


@pytest.mark.parametrize("net", [True, False], ids=["capture", "eager_net"])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_across_zero_grad_in_place_is_the_gradient_under_optimizer_step(
    backend: str, device: str, keep: str, net: bool
) -> None:
    """The optimizer step replayed, after a replayed network or an eager one (Lightning's automatic
    optimization): it copies its clipped gradients back into the parameters' own tensors."""
    eager, _ = _zero_in_place_loop(keep, device, None)
    replay, entries = _zero_in_place_loop(keep, device, backend, opt_step={}, net=net)
    assert _same(eager, replay), entries[-1].journal.format()
    assert all(e.counts["replay"] > 0 for e in entries), entries[-1].journal.format()


@pytest.mark.parametrize("keep", list(KEEP))
def test_without_grad_inputs_a_kept_grad_differs_under_optimizer_step(
    backend: str, device: str, keep: str
) -> None:
    eager, _ = _zero_in_place_loop(keep, device, None)
    with pytest.warns(rk.ReplayWarning):
        replay, (opt_step,) = _zero_in_place_loop(
            keep,
            device,
            backend,
            opt_step={"unsafe_disable": negative_control("grad_inputs")},
            net=False,
        )
    assert opt_step.counts["replay"] > 0
    assert not _same(eager, replay)


def _micro_batch_loop(
    keep: str, device: str, backend: str | None, accumulate: int, **kw
) -> tuple[Seen, rk.TrainStep]:
    """A whole step over micro-batches; after each call the tensors kept so far are read and the
    current ``.grad`` kept."""
    torch.manual_seed(0)
    model = SmallNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = rk.TrainStep(
        model,
        small_loss,
        opt,
        accumulate=accumulate,
        replay=backend is not None,
        backend=backend or "emulated",
        **kw,
    )
    seen: Seen = []
    kept: list[torch.Tensor] = []
    for x, y in _batches(device, 4 * accumulate):
        step(x, y)
        grad = model.head.weight.grad
        for k in kept:
            _look(k, grad, seen)
        if grad is not None:
            kept.append(KEEP[keep](grad))
    return seen, step


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("accumulate", [2, 3])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_between_micro_batches_is_the_running_sum_under_train_step(
    backend: str, device: str, keep: str, accumulate: int, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between micro-batches ``.grad`` is one tensor holding the running sum (the same tensor, as
    eager's); kept past the optimizer step it keeps that step's sum."""
    _way(way, monkeypatch)
    eager, _ = _micro_batch_loop(keep, device, None, accumulate)
    replay, step = _micro_batch_loop(keep, device, backend, accumulate)
    assert _same(eager, replay), step.journal.format()
    if way == "move" or keep == "ref":
        assert step.counts["replay"] > 0 and not step.eager_reasons["live_alias"]
    else:
        assert step.eager_reasons["live_alias"] > 0, step.journal.format()


@pytest.mark.parametrize("keep", list(KEEP))
def test_without_copy_out_a_kept_grad_differs_under_train_step(
    backend: str, device: str, keep: str
) -> None:
    eager, _ = _micro_batch_loop(keep, device, None, 2)
    with pytest.warns(rk.ReplayWarning):
        replay, step = _micro_batch_loop(
            keep, device, backend, 2, unsafe_disable=negative_control("copy_out")
        )
    assert step.counts["replay"] > 0
    assert not _same(eager, replay)
