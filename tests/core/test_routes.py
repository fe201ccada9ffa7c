"""Signatures and routes: record while the budget lasts, replay, or eager with a reason."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit import route as route_module
from replaykit.protections import negative_control
from replaykit.testing.nets import DetectionNet
from replaykit.testing.parity.trial import Trial, compare
from tests.nets import WithKwargs


def _captured(device: str, backend: str, **kw):
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    return model, rk.capture(model, backend=backend, **kw)


@pytest.mark.parametrize("partial", ["last", "between"])
def test_partial_batches_keep_parity(backend: str, device: str, partial: str) -> None:
    diffs, _, replay = compare(
        Trial(steps=3, accumulation=2, partial=partial, device=device),
        DetectionNet,
        backend=backend,
    )
    assert diffs == []
    assert replay.recorder["record"] == 2


def test_partial_batch_past_the_budget_runs_eager_with_parity(backend: str, device: str) -> None:
    trial = Trial(steps=3, accumulation=2, partial="between", device=device)
    diffs, _, replay = compare(trial, DetectionNet, backend=backend, max_recordings=1)
    assert diffs == []
    assert replay.recorder["eager_reasons"] == {"budget": 1}


def test_no_grad_and_eval_route_eager(backend: str, device: str) -> None:
    model, rec = _captured(device, backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        model(x)
    model.eval()
    ref = model(x)
    model.train()
    assert dict(rec.eager_reasons) == {"no_grad": 2, "eval": 1}
    assert rec.counts["record"] == 0
    assert all(not v.requires_grad or v.grad_fn is not None for v in ref.values())
    rec.release()


def test_autocast_state_is_part_of_the_signature(backend: str, device: str) -> None:
    model, rec = _captured(device, backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    model(x)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out = model(x)
    assert out["o2m_cls"].dtype == torch.bfloat16
    assert rec.counts["record"] == 2
    rec.release()


def test_kwargs_non_tensor_arguments_and_nested_outputs(backend: str, device: str) -> None:
    torch.manual_seed(0)
    eager, model = WithKwargs().to(device), WithKwargs().to(device)
    model.load_state_dict(eager.state_dict())
    rec = rk.capture(model, backend=backend)
    for scale in (1.0, 1.0, 2.0, 1.0):
        x = torch.randn(3, 5, device=device)
        bias = torch.randn(5, device=device, requires_grad=True)
        outs = [m(x, bias=bias, scale=scale) for m in (eager, model)]
        for o in outs:
            (o["y"].square().sum() + o["pair"][0].sum() + o["pair"][1].mean()).backward()
        assert torch.equal(outs[0]["pair"][1], outs[1]["pair"][1])
    for p, q in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert rec.counts["record"] == 2, rec.journal.format()  # scale=2.0 is a new signature
    assert rec.counts["replay"] == 2
    rec.release()


@pytest.mark.parametrize("reader", ["getter", "probe"])
def test_saved_tensors_hooks_route_eager_calling_each_hook_as_eager_does(
    backend: str, device: str, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved-tensor hooks (activation compression, offload) route eager. torch 2.4 has no getter
    for them: the probe that stands in there (forced here on any torch) must see them, call none
    of them itself, and leave a ``disable_saved_tensors_hooks`` context's message as it was."""
    if reader == "probe":
        monkeypatch.setattr(route_module, "_saved_hooks", None)
    elif route_module._saved_hooks is None:
        pytest.skip("this torch has no getter for saved-tensor hooks (2.4): the probe reads them")
    torch.manual_seed(0)
    twin = DetectionNet().to(device)
    model, rec = _captured(device, backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    packs = {"twin": 0, "captured": 0}

    def counting(name: str):
        def pack(t: torch.Tensor) -> torch.Tensor:
            packs[name] += 1
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    for name, net in (("twin", twin), ("captured", model)):
        with counting(name):
            net(x)
    assert packs["twin"] > 0 and packs["captured"] == packs["twin"]
    model(x)
    model.eval()  # eval routes after autograd's mode is read: the read runs, nothing records
    with torch.autograd.graph.disable_saved_tensors_hooks("the caller's message"):
        model(x)
        assert (
            torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
            == "the caller's message"
        )
    model.train()
    model(x)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    assert dict(rec.eager_reasons) == {"saved_tensors_hooks": 1, "eval": 1}
    assert rec.counts["record"] == 1 and rec.counts["replay"] == 1, rec.journal.format()
    rec.release()


class Unhashable:
    __hash__ = None  # type: ignore[assignment]


def test_unhashable_argument_routes_eager(backend: str, device: str) -> None:
    model = WithKwargs().to(device)
    rec = rk.capture(model, backend=backend)
    model(
        torch.randn(3, 5, device=device), bias=torch.zeros(5, device=device), options=Unhashable()
    )
    assert rec.eager_reasons["unhashable_argument"] == 1
    rec.release()


@pytest.mark.parametrize("route", ["no_grad", "eval", "budget", "hold"])
def test_strict_raises_instead_of_eager(backend: str, device: str, route: str) -> None:
    model, rec = _captured(device, backend, strict=True, max_recordings=1)
    x = torch.randn(2, 3, 8, 8, device=device)
    out = model(x)
    if route != "hold":
        del out
    with pytest.raises(rk.ReplayError, match=route):
        if route == "no_grad":
            with torch.no_grad():
                model(x)
        elif route == "eval":
            model.eval()
            model(x)
        elif route == "budget":
            model(torch.randn(3, 3, 8, 8, device=device))
        else:
            model(x)
    rec.release()


class _WritesInput(torch.nn.Module):
    """Normalises its input in place, the way a user's preprocessing might."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how = torch.nn.Linear(4, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "foreach_mul_":
            torch._foreach_mul_([x], 0.5)
        elif self.how == "data":
            x.data.mul_(0.5)  # moves no version counter of x
        else:
            x.mul_(0.5)
        return self.lin(x)


@pytest.mark.parametrize("how", ["mul_", "foreach_mul_", "data"])
def test_a_forward_writing_its_input_replays_and_writes_the_callers_tensor(
    backend: str, device: str, how: str
) -> None:
    """The caller's tensor is written at every call, as eager writes it: the replay's static copy
    is written back (``write_back``), with a version bump. A foreach op bumps no version counter
    under a dispatch mode (the probe's, the tape's), a write through ``.data`` none at all: the
    write is found by the storage it writes and written back too."""
    torch.manual_seed(0)
    model = _WritesInput(how).to(device)
    eager = torch.ones(3, 4, device=device)
    model(eager)  # before the capture: how far eager moves the version
    rec = rk.capture(model, backend=backend)
    try:
        for _ in range(3):
            x = torch.ones(3, 4, device=device)
            model(x).sum().backward()
            assert torch.equal(x, torch.full_like(x, 0.5))
            assert x._version == eager._version
        assert rec.counts["replay"] == 2 and not rec.retired, rec.journal
    finally:
        rec.release()


def test_without_write_back_a_replay_leaves_the_callers_tensor(backend: str, device: str) -> None:
    """The negative control: the replays write their static copy, the caller's tensor stays."""
    torch.manual_seed(0)
    model = _WritesInput("mul_").to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=negative_control("write_back"))
    try:
        x = torch.ones(3, 4, device=device)
        model(x).sum().backward()  # recorded, then replayed
        assert rec.counts["record"] == 1 and not rec.retired
        assert torch.equal(x, torch.ones_like(x))  # eager leaves 0.5
    finally:
        rec.release()


class _WritesFirst(torch.nn.Module):
    """Halves its first input in place, then reads both: eager's write shows through a second
    input sharing the first one's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.lin(x) + self.lin(y)


def _written_and_read(
    aliased_at: tuple[int, ...], device: str, backend: str | None, check_every: int = 0
) -> tuple[list[torch.Tensor], rk.Recorder | None]:
    torch.manual_seed(0)
    model = _WritesFirst().to(device)
    rec = rk.capture(model, backend=backend, check_every=check_every) if backend else None
    kept: list[torch.Tensor] = []
    try:
        for i in range(5):
            x = torch.randn(3, 4, device=device)
            y = x.view(3, 4) if i in aliased_at else x.clone()
            model(x, y).pow(2).sum().backward()
            kept += [x, y, model.lin.weight.grad.clone()]
    finally:
        if rec is not None:
            rec.release()
    return kept, rec


@pytest.mark.parametrize("aliased_at", [(0,), (2, 4), ()], ids=["recording", "replay", "apart"])
def test_a_written_input_sharing_memory_with_another_runs_eagerly(
    backend: str, device: str, aliased_at: tuple[int, ...]
) -> None:
    """``model(x, x.view(...))`` with ``x`` written in place: a replay's static copies are apart,
    so the recording call retires with the write's reason, a later call runs eagerly."""
    eager, _ = _written_and_read(aliased_at, device, None)
    replayed, rec = _written_and_read(aliased_at, device, backend)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True)), rec.journal
    if aliased_at == (0,):
        assert rec.retired and "writes input 0 in place" in rec.retire_reason
        assert "shares memory" in rec.retire_reason
    else:
        assert rec.eager_reasons["written_input_aliased"] == len(aliased_at), rec.journal
        assert rec.counts["replay"] == 4 - len(aliased_at)


def test_a_checked_replay_compares_the_written_input(backend: str, device: str) -> None:
    """Under ``check_every=1`` every replay is checked against eager, the written input included,
    and eager's rerun at the backward starts from the input as the call found it."""
    eager, _ = _written_and_read((), device, None)
    replayed, rec = _written_and_read((), device, backend, check_every=1)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True)), rec.journal
    assert rec.counts["replay"] == 4 and not rec.retired, rec.journal
    assert "diverged" not in rec.eager_reasons


def test_a_written_strided_view_writes_its_base_as_eager_does(backend: str, device: str) -> None:
    """``model(base[:, ::2])`` with the view written in place: eager writes through into ``base``;
    the write-back into the caller's view does the same."""
    bases: dict[bool, list[torch.Tensor]] = {}
    for replay in (False, True):
        torch.manual_seed(0)
        model = _WritesInput("mul_").to(device)
        rec = rk.capture(model, backend=backend) if replay else None
        bases[replay] = []
        for i in range(3):
            base = torch.arange(24.0, device=device).reshape(3, 8) + i
            model(base[:, ::2]).sum().backward()
            bases[replay] += [base, model.lin.weight.grad.clone()]
        if rec is not None:
            assert rec.counts["replay"] == 2, rec.journal
            rec.release()
    assert all(torch.equal(a, b) for a, b in zip(bases[False], bases[True], strict=True))
