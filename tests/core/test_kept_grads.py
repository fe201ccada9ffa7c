"""A reference, view or ``.data`` of ``p.grad`` the caller keeps is the gradient eager's would be.

Eager's ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place and the next backward
accumulates into it; between a whole step's micro-batches ``.grad`` is one running sum. So
whatever the caller kept of ``.grad`` (a gradient-norm history, an optimizer's view) *is* the next
gradient: values and storage, at every step. Copy-out moves a held gradient with every holder of
its storage (``memory/copy_out.py``); on a torch without the storage swap it leaves such a
gradient in place: where it is ``.grad`` the recorder gives it to the caller and records anew
(``grads_given_away``: later calls replay, accumulating into it as eager does), the whole step
runs the call eagerly (``live_alias``). The loops: ``replaykit/testing/parity/kept_grads.py``.
"""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.protections import negative_control
from replaykit.testing.parity.kept_grads import (
    KEEP,
    STEPS,
    kept_after_set_to_none,
    micro_batch_loop,
    same,
    zero_in_place_loop,
)

#: the re-record that gives held gradients away, as the journal and summary() name it
GIVEN = "grads_given_away"


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
    assert not rec.eager_reasons, rec.journal.format()
    if way == "move" or keep == "ref":  # they replay: the gradient moved (with its holders) once
        assert rec.counts["replay"] == STEPS - 1, rec.journal.format()
    else:  # a holder the rebinding cannot reach: given away at call 2, recorded anew, replayed
        assert rec.counts["rerecord"] == 1 and rec.counts["replay"] == STEPS - 2, rec.journal
        given = [e for e in rec.journal if e.kind == "rerecord"]
        assert given[0].reason == GIVEN and given[0].call == 2, rec.journal.format()
        assert f"re-recorded for: {GIVEN} x1" in rec.summary()
    rec.release()


def test_a_grad_given_away_drops_the_recordings_of_every_signature(
    backend: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of two shapes: the held gradient is found by the second signature's first call; the
    first signature's recording could write its memory too (graphs sharing a pool reuse each
    other's freed blocks), so both are dropped and each records anew, then replays."""
    _way("eager", monkeypatch)
    eager, _ = zero_in_place_loop("view", device, None, rows=(8, 6))
    replay, (rec,) = zero_in_place_loop("view", device, backend, rows=(8, 6))
    assert same(eager, replay), rec.journal.format()
    assert rec.counts["rerecord"] == 1 and not rec.eager_reasons, rec.summary()
    assert rec.counts["record"] == 3 and rec.counts["replay"] == STEPS - 3, rec.summary()
    rec.release()


def test_a_give_away_past_the_rerecord_budget_retires(
    backend: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The give-away is a re-record: with none left (``max_rerecords=0``) the recorder retires,
    says why, and the calls run eagerly (exact)."""
    _way("eager", monkeypatch)
    eager, _ = zero_in_place_loop("view", device, None)
    with pytest.warns(rk.ReplayWarning, match=GIVEN):
        replay, (rec,) = zero_in_place_loop("view", device, backend, max_rerecords=0)
    assert same(eager, replay), rec.journal.format()
    assert rec.retired and rec.retire_reason.startswith(GIVEN), rec.summary()
    assert rec.eager_reasons["retired"] == STEPS - 1, rec.summary()


def test_a_grad_set_to_none_but_still_held_is_not_given_away(
    backend: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``zero_grad(set_to_none=True)`` with every step's gradient kept as a view: the held buffer
    is not ``.grad`` any more, and the next backward would adopt a new buffer the caller keeps
    again, so giving it away would re-record every call; the call runs eagerly instead."""
    _way("eager", monkeypatch)
    eager, _ = kept_after_set_to_none(device, None)
    replay, rec = kept_after_set_to_none(device, backend)
    assert same(eager, replay), rec.journal.format()
    assert rec.counts["rerecord"] == 0 and rec.eager_reasons["live_alias"] > 0, rec.summary()


@pytest.mark.parametrize("others", [False, True], ids=["sole_user", "shared"])
def test_a_grad_in_a_shared_pool_is_given_away_only_by_its_sole_user(
    backend: str, device: str, others: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``MemoryPool`` another entry point records into too: its graphs may reuse the held
    block, so the gradient is not given away and the call runs eagerly (exact); alone in a pool,
    it is given away as with the recorder's own pool."""
    _way("eager", monkeypatch)
    eager, _ = zero_in_place_loop("view", device, None)
    pool = rk.MemoryPool()
    other = torch.nn.Linear(8, 4).to(device)
    shared = rk.capture(other, backend=backend, pool=pool) if others else None
    replay, (rec,) = zero_in_place_loop("view", device, backend, pool=pool)
    assert same(eager, replay), rec.journal.format()
    if others:
        assert rec.counts["rerecord"] == 0, rec.journal.format()
        assert rec.eager_reasons["live_alias"] == STEPS - 1, rec.summary()
        shared.release()
    else:
        assert rec.counts["rerecord"] == 1 and rec.counts["replay"] == STEPS - 2, rec.summary()
    rec.release()


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("keep", list(KEEP))
def test_without_copy_out_a_kept_grad_differs_under_capture(
    backend: str, device: str, keep: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _way(way, monkeypatch)
    eager, _ = zero_in_place_loop(keep, device, None)
    with pytest.warns(rk.ReplayWarning):
        replay, (rec,) = zero_in_place_loop(
            keep, device, backend, unsafe_disable=negative_control("copy_out")
        )
    assert rec.counts["replay"] > 0
    assert not same(eager, replay)


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("net", [True, False], ids=["capture", "eager_net"])
@pytest.mark.parametrize("keep", list(KEEP))
def test_a_grad_kept_across_zero_grad_in_place_is_the_gradient_under_optimizer_step(
    backend: str, device: str, keep: str, net: bool, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer step replayed, after a replayed network or an eager one (Lightning's automatic
    optimization): it copies its clipped gradients back into the parameters' own tensors."""
    _way(way, monkeypatch)
    eager, _ = zero_in_place_loop(keep, device, None)
    replay, entries = zero_in_place_loop(keep, device, backend, opt_step={}, net=net)
    assert same(eager, replay), entries[-1].journal.format()
    if net and keep != "ref" and not copy_out.holders_move():  # torch 2.11: given away once
        assert entries[0].counts["rerecord"] == 1, entries[0].journal.format()
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
    assert rec.counts["replay"] > 0 and not rec.eager_reasons["live_alias"], rec.journal.format()
