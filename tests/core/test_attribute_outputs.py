"""A forward that assigns a tensor to a module attribute without reading the old one (an MoE
layer's ``self.aux_loss``, ``self.last_attn = attn.detach()`` for logging) replays under
``rk.capture``: the tensor is one more output of the recording, assigned after each replay
(protection ``attribute_outputs``). A forward that reads the old value too (a running centre, a
cache grown on a longer batch) reads it from a slot fed before each replay. Every call is compared with a plain eager loop: losses, parameters, each ``.grad``
and its None pattern, and the attributes, after every call."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control
from replaykit.testing.hazards.recording_call import CentredHead
from replaykit.testing.hazards.side_effects import (
    Cache,
    FirstBatchCentre,
    HeldState,
    KeepsOutput,
    LoggedAttention,
    MoE,
    MoEStack,
    RunningCentre,
)

from ._same import same


def _aux(model: nn.Module) -> torch.Tensor:
    return model.aux_loss


def _both(model: nn.Module) -> torch.Tensor:
    return model.a.aux_loss + model.b.aux_loss


Loss = Callable[[nn.Module], torch.Tensor] | None


def _attributes(model: nn.Module) -> list[tuple[str, torch.Tensor | None, bool, bool]]:
    """Each tensor attribute of the tree: name, values, requires_grad, whether it has a grad_fn."""
    return [
        (f"{n}.{k}", v.detach().clone(), v.requires_grad, v.grad_fn is not None)
        for n, m in model.named_modules()
        for k, v in m.__dict__.items()
        if isinstance(v, torch.Tensor)
    ]


def _train(
    make: type[nn.Module],
    extra: Loss,
    device: str,
    backend: str | None,
    unsafe: tuple[str, ...] = (),
    steps: int = 6,
) -> tuple[list, rk.Recorder | None]:
    """A plain loop (captured unless ``backend`` is None): what each call leaves, and the recorder."""
    torch.manual_seed(0)
    model = make().to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(torch.randn(4 + step % 2, 6, device=device))
        loss = out.pow(2).mean() + (0.1 * extra(model) if extra is not None else 0.0)
        loss.backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        seen.append((loss.detach(), grads, _attributes(model)))
    seen.append([p.detach().clone() for p in model.parameters()])
    return seen, rec


CASES = [
    pytest.param(MoE, _aux, id="moe_aux_loss_in_the_loss"),
    pytest.param(MoE, None, id="moe_aux_loss_unused"),
    pytest.param(LoggedAttention, None, id="last_attn_detached"),
    pytest.param(MoEStack, _both, id="nested_moe_and_attention"),
]


@pytest.mark.parametrize(("make", "extra"), CASES)
def test_an_assigned_tensor_attribute_replays_like_eager(
    backend: str, device: str, make: type[nn.Module], extra: Loss
) -> None:
    eager, _ = _train(make, extra, device, None)
    replayed, rec = _train(make, extra, device, backend)
    for call, (want, got) in enumerate(zip(eager, replayed, strict=True), 1):
        assert same(want, got), f"call {call}: {rec.journal.format()}"
    # the first call learns the write (first_write); two signatures record; the rest replay
    assert rec.counts["replay"] >= 3 and not rec.retired, rec.summary()
    assert set(rec.eager_reasons) == {"first_write"}, rec.summary()


@pytest.mark.parametrize(("make", "extra"), [CASES[0], CASES[2]])
def test_without_attribute_outputs_the_attribute_keeps_an_earlier_tensor(
    backend: str, device: str, make: type[nn.Module], extra: Loss
) -> None:
    """The negative control: recorded, replayed, but not assigned. The MoE loss then reaches the
    first call's freed graph (autograd raises); the attention weights stay the first call's."""
    eager, _ = _train(make, extra, device, None)
    try:
        replayed, _ = _train(make, extra, device, backend, negative_control("attribute_outputs"))
    except RuntimeError as exc:
        assert extra is not None and "backward through the graph a second time" in str(exc)
        return
    assert not same(eager, replayed)


def test_the_attribute_is_a_new_tensor_each_call_as_in_eager(backend: str, device: str) -> None:
    """Eager's assignment binds a new tensor per call; a kept one keeps its values (copy-out)."""
    torch.manual_seed(0)
    model = MoE().to(device)
    rec = rk.capture(model, backend=backend)
    kept, values = [], []
    for _ in range(5):
        out = model(torch.randn(4, 6, device=device))
        (out.pow(2).mean() + model.aux_loss).backward()
        assert model.aux_loss.requires_grad and not model.aux_loss.is_leaf
        assert all(model.aux_loss is not k for k in kept)
        kept.append(model.aux_loss)
        values.append(model.aux_loss.detach().clone())
    assert rec.counts["replay"] >= 3, rec.summary()
    assert all(torch.equal(k.detach(), v) for k, v in zip(kept, values, strict=True))


def test_an_attribute_bound_to_an_output_is_that_output(backend: str, device: str) -> None:
    """``self.last = out; return out``: one tensor object, as in eager."""
    torch.manual_seed(0)
    model = KeepsOutput().to(device)
    rec = rk.capture(model, backend=backend)
    for _ in range(4):
        out = model(torch.randn(4, 6, device=device))
        assert model.last is out
        out.pow(2).mean().backward()
    assert rec.counts["replay"] >= 2, rec.summary()


def _feature(model: nn.Module) -> torch.Tensor:
    return model.feats["h"].pow(2).mean()


def _kept_on_object(model: nn.Module) -> torch.Tensor:
    return model.state.last.abs().mean()


HELD = [
    pytest.param(Cache, _feature, id="feature_dict_entry"),
    pytest.param(HeldState, _kept_on_object, id="plain_object_attribute"),
]


@pytest.mark.parametrize(("make", "extra"), HELD)
def test_an_entry_of_a_held_container_replays_like_eager(
    backend: str, device: str, make: type[nn.Module], extra: Loss
) -> None:
    """``self.feats["h"] = h`` (a feature-matching loss reads it), ``self.state.last = out``: the
    entry is one more output, set after each replay; the loss backpropagates through it."""
    eager, _ = _train(make, extra, device, None)
    replayed, rec = _train(make, extra, device, backend)
    for call, (want, got) in enumerate(zip(eager, replayed, strict=True), 1):
        assert same(want, got), f"call {call}: {rec.journal.format()}"
    assert rec.counts["replay"] >= 3 and not rec.retired, rec.summary()
    assert set(rec.eager_reasons) == {"first_write"}, rec.summary()


@pytest.mark.parametrize(("make", "extra"), HELD)
def test_without_attribute_outputs_the_entry_keeps_an_earlier_tensor(
    backend: str, device: str, make: type[nn.Module], extra: Loss
) -> None:
    """The negative control: the loss reaches the first call's freed graph (autograd raises)."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _train(make, extra, device, backend, negative_control("attribute_outputs"))


class GrowingTable(nn.Module):
    """A cache built on first use and rebuilt when a longer batch arrives (a RoPE table): read
    every call, assigned only on those."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.table is None or self.table.shape[0] < n:
            self.table = torch.arange(n * 6.0, device=x.device).reshape(n, 6).sin()
        return self.fc(x) * self.table[:n]


class HeldCentre(nn.Module):
    """The running centre kept in a dict the module holds (``self.stats["center"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.stats = {"center": torch.zeros(3)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.stats["center"] = 0.9 * self.stats["center"].to(h.device) + 0.1 * h.detach().mean(0)
        return h - self.stats["center"]


STATES = [
    pytest.param(RunningCentre, id="running_centre"),
    pytest.param(FirstBatchCentre, id="centre_from_the_first_batch"),
    pytest.param(CentredHead, id="registered_buffer_re_bound"),
    pytest.param(HeldCentre, id="entry_of_a_held_dict"),
    pytest.param(GrowingTable, id="cache_grown_on_a_longer_batch"),
]


@pytest.mark.parametrize("make", STATES)
def test_a_forward_reading_the_attribute_it_assigns_replays_from_a_slot(
    backend: str, device: str, make: type[nn.Module]
) -> None:
    """A state: each replay reads the attribute's tensor as the call found it (copied into the
    recording's slot) and assigns the new one, as eager's forward does."""
    eager, _ = _train(make, None, device, None, steps=8)
    replayed, rec = _train(make, None, device, backend, steps=8)
    for call, (want, got) in enumerate(zip(eager, replayed, strict=True), 1):
        assert same(want, got), f"call {call}: {rec.journal.format()}"
    assert rec.counts["replay"] >= 3 and not rec.retired, rec.summary()
    # a call that builds the table anew returns it computed from no input (output_constant)
    grown = {"output_constant"} if make is GrowingTable else set()
    assert set(rec.eager_reasons) - grown == {"first_write"}, rec.summary()


@pytest.mark.parametrize("make", STATES[:4])
def test_without_attribute_outputs_a_state_keeps_an_earlier_tensor(
    backend: str, device: str, make: type[nn.Module]
) -> None:
    """The negative control: not assigned after a replay, the next feed reads a stale centre."""
    eager, _ = _train(make, None, device, None, steps=8)
    replayed, _ = _train(make, None, device, backend, negative_control("attribute_outputs"), 8)
    assert not same(eager, replayed)


def test_a_re_bound_buffer_stays_a_registered_buffer(backend: str, device: str) -> None:
    """DINO's centre: after each replay ``center`` is the module's buffer (state_dict, .to())
    holding eager's values, a new tensor per call."""
    torch.manual_seed(0)
    model = CentredHead().to(device)
    eager = copy.deepcopy(model)
    rec = rk.capture(model, backend=backend)
    seen = []
    for _ in range(5):
        x = torch.randn(4, 6, device=device)
        model(x).pow(2).mean().backward()
        eager(x).pow(2).mean().backward()
        assert torch.equal(model.state_dict()["center"], eager.state_dict()["center"])
        assert all(model.center is not t for t in seen)
        seen.append(model.center)
    assert dict(model.named_buffers())["center"] is model.center
    assert rec.counts["replay"] >= 3, rec.summary()


class GradCentre(RunningCentre):
    """A centre that keeps its graph (no detach): one call's backward reaches the last's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.centre = 0.9 * self.centre.to(h.device).detach() + 0.1 * h.mean(0)
        return h - self.centre


def test_a_state_that_requires_grad_stays_eager(backend: str, device: str) -> None:
    """A slot would cut the graph the attribute carries: exact, never replayed."""
    eager, _ = _train(GradCentre, None, device, None)
    replayed, rec = _train(GradCentre, None, device, backend)
    assert same(eager, replayed)
    assert rec.counts["replay"] == 0, rec.summary()
