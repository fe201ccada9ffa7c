"""A reference, view or ``.data`` of ``p.grad`` the caller keeps is the gradient eager's would be.

Eager's ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place and the next backward
accumulates into it; between a whole step's micro-batches ``.grad`` is one running sum. So
whatever the caller kept of ``.grad`` (a gradient-norm history, an optimizer's view) *is* the next
gradient: values and storage, at every step. Copy-out moves a held gradient with every holder of
its storage (``memory/copy_out.py``); on a torch without the storage swap it leaves such a
gradient in place and the call runs eagerly (``live_alias``). The loops:
``replaykit/testing/parity/kept_grads.py``.
"""

from __future__ import annotations

import pytest

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.protections import negative_control
from replaykit.testing.parity.kept_grads import (
    KEEP,
    STEPS,
    micro_batch_loop,
    same,
    zero_in_place_loop,
)


def _way(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``move``: this torch's storage swap; ``eager``: as on a torch without it."""
    if way == "eager":
        monkeypatch.setattr(copy_out, "_swap", None)
    elif not copy_out.holders_move():
        pytest.skip("this torch cannot move a held storage")


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_across_zero_grad_in_place_is_the_gradient_under_capture(
    backend: str, device: str, keep: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _way(way, monkeypatch)
    eager, _ = zero_in_place_loop(keep, device, None)
    replay, (rec,) = zero_in_place_loop(keep, device, backend)
    assert same(eager, replay), rec.journal.format()
    if way == "move":  # they replay: the gradient moved with its holders once
        assert rec.counts["replay"] == STEPS - 1 and not rec.eager_reasons, rec.journal.format()
    elif keep != "ref":  # a holder the rebinding cannot reach: eager while it is held
        assert rec.eager_reasons["live_alias"] > 0, rec.journal.format()
    rec.release()


@pytest.mark.parametrize("keep", list(KEEP))
def test_without_copy_out_a_kept_grad_differs_under_capture(
    backend: str, device: str, keep: str
) -> None:
    eager, _ = zero_in_place_loop(keep, device, None)
    with pytest.warns(rk.ReplayWarning):
        replay, (rec,) = zero_in_place_loop(
            keep, device, backend, unsafe_disable=negative_control("copy_out")
        )
    assert rec.counts["replay"] > 0
    assert not same(eager, replay)


@pytest.mark.parametrize("net", [True, False], ids=["capture", "eager_net"])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_across_zero_grad_in_place_is_the_gradient_under_optimizer_step(
    backend: str, device: str, keep: str, net: bool
) -> None:
    """The optimizer step replayed, after a replayed network or an eager one (Lightning's automatic
    optimization): it copies its clipped gradients back into the parameters' own tensors."""
    eager, _ = zero_in_place_loop(keep, device, None)
    replay, entries = zero_in_place_loop(keep, device, backend, opt_step={}, net=net)
    assert same(eager, replay), entries[-1].journal.format()
    if net and keep != "ref" and not copy_out.holders_move():  # torch 2.11: eager while held
        assert entries[0].eager_reasons["live_alias"] > 0, entries[0].journal.format()
        entries = entries[1:]
    assert all(e.counts["replay"] > 0 for e in entries), entries[-1].journal.format()


@pytest.mark.parametrize("keep", list(KEEP))
def test_without_grad_inputs_a_kept_grad_differs_under_optimizer_step(
    backend: str, device: str, keep: str
) -> None:
    eager, _ = zero_in_place_loop(keep, device, None)
    with pytest.warns(rk.ReplayWarning):
        replay, (opt_step,) = zero_in_place_loop(
            keep,
            device,
            backend,
            opt_step={"unsafe_disable": negative_control("grad_inputs")},
            net=False,
        )
    assert opt_step.counts["replay"] > 0
    assert not same(eager, replay)


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("accumulate", [2, 3])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_between_micro_batches_is_the_running_sum_under_train_step(
    backend: str, device: str, keep: str, accumulate: int, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between micro-batches ``.grad`` is one tensor holding the running sum (the same tensor, as
    eager's); kept past the optimizer step it keeps that step's sum."""
    _way(way, monkeypatch)
    eager, _ = micro_batch_loop(keep, device, None, accumulate)
    replay, step = micro_batch_loop(keep, device, backend, accumulate)
    assert same(eager, replay), step.journal.format()
    if way == "move" or keep == "ref":
        assert step.counts["replay"] > 0 and not step.eager_reasons["live_alias"]
    else:
        assert step.eager_reasons["live_alias"] > 0, step.journal.format()


@pytest.mark.parametrize("keep", list(KEEP))
def test_without_copy_out_a_kept_grad_differs_under_train_step(
    backend: str, device: str, keep: str
) -> None:
    eager, _ = micro_batch_loop(keep, device, None, 2)
    with pytest.warns(rk.ReplayWarning):
        replay, step = micro_batch_loop(
            keep, device, backend, 2, unsafe_disable=negative_control("copy_out")
        )
    assert step.counts["replay"] > 0
    assert not same(eager, replay)


@pytest.mark.parametrize("way", ["move", "eager"])
def test_a_kept_view_follows_the_gradient_with_a_fused_optimizer_and_a_grad_scaler(
    backend: str, device: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Autocast, a ``GradScaler`` unscaling ``.grad`` in place and fused AdamW reading every
    gradient at once: the kept view is unscaled with ``.grad``, as eager's."""
    _way(way, monkeypatch)
    options = {"optimizer": "adamw", "amp": True}
    eager, _ = zero_in_place_loop("view", device, None, **options)
    replay, (rec,) = zero_in_place_loop("view", device, backend, **options)
    assert same(eager, replay), rec.journal.format()
    assert rec.counts["replay"] > 0 or way == "eager", rec.journal.format()
