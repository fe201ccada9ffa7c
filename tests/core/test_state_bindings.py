"""What a forward does with the module's own tensors that no replay repeats (``verify/bindings.py``).

A forward rebinding a weight's ``.data`` (MoCo's momentum encoder) would be applied again by each
of the recording call's runs and never by a replay: the call runs eagerly, the weight bound back
to its storage first, and a recurring rebind retires naming it (``data_rebind``). A forward
returning a parameter or buffer the caller keeps (CLIP's ``logit_scale``, a VQ-VAE's EMA
codebook) gets the module's own tensor, as eager (``output_state``). Each compared with a plain
eager loop: losses, parameters, every ``.grad``, buffers and what the loop kept.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards.side_effects import MomentumEncoder, ReturnsState


def _state(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, every ``.grad`` (None as a marker) and buffers."""
    grads = [p.grad if p.grad is not None else torch.empty(0) for p in model.parameters()]
    return [*model.parameters(), *grads, *model.buffers()]


def _momentum(device: str, backend: str | None, inplace: bool = False, unsafe=()) -> tuple:
    torch.manual_seed(0)
    model = MomentumEncoder(inplace).to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(model.q.parameters(), lr=0.1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.ReplayWarning)
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(8, 6, device=device)).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return [*losses, *_state(model)], rec


def _returns(device: str, backend: str | None, what: str, unsafe=()) -> tuple:
    torch.manual_seed(0)
    model = ReturnsState(what).to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept, own = [], []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        y, extra = model(torch.randn(8, 6, device=device))
        own.append(extra is (model.codebook if what == "buffer" else model.logit_scale))
        loss = (y * extra).pow(2).mean()
        loss.backward()
        opt.step()
        kept += [loss.detach(), extra]  # eager: every kept entry is the live tensor
    return [*(k.detach().clone() for k in kept), *_state(model)], own, rec


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_forward_rebinding_a_weights_data_runs_eagerly_and_retires_naming_it(
    backend: str, device: str
) -> None:
    eager, _ = _momentum(device, None)
    replayed, rec = _momentum(device, backend)
    assert _same(eager, replayed), rec.summary()
    assert rec.retired and "k.weight.data = ..." in rec.retire_reason, rec.summary()
    assert "mul_(m).add_(q" in rec.retire_reason  # the in-place form, which replays


def test_the_in_place_momentum_update_still_replays(backend: str, device: str) -> None:
    eager, _ = _momentum(device, None, inplace=True)
    replayed, rec = _momentum(device, backend, inplace=True)
    assert _same(eager, replayed) and rec.counts["replay"] > 0, rec.summary()


def test_without_data_rebind_the_momentum_weights_move_at_each_extra_run(
    backend: str, device: str
) -> None:
    eager, _ = _momentum(device, None)
    replayed, rec = _momentum(device, backend, unsafe=("data_rebind",))
    assert not _same(eager, replayed), rec.summary()


@pytest.mark.parametrize("what", ["buffer", "parameter"])
def test_a_returned_buffer_or_parameter_is_the_modules_own_tensor(
    backend: str, device: str, what: str
) -> None:
    eager, _, _ = _returns(device, None, what)
    replayed, own, rec = _returns(device, backend, what)
    assert _same(eager, replayed), rec.summary()
    assert all(own), own  # the recording call's too
    assert rec.eager_reasons["output_aliases_state"] >= 1, rec.summary()
    refusal = next(e for e in rec.journal if e.reason == "output_aliases_state" and e.detail)
    assert f"ReturnsState.{'codebook' if what == 'buffer' else 'logit_scale'}" in refusal.detail


@pytest.mark.parametrize("what", ["buffer", "parameter"])
def test_without_output_state_the_entry_kept_from_the_recording_call_freezes(
    backend: str, device: str, what: str
) -> None:
    eager, _, _ = _returns(device, None, what)
    replayed, _, rec = _returns(device, backend, what, unsafe=("output_state",))
    assert not _same(eager, replayed), rec.summary()
