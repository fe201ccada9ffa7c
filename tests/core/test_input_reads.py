"""Host reads of values computed from the inputs alone key the recording; reads of the model's state still
retire; a write into the model made once routes that call eagerly instead of retiring."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control


class Lengths(nn.Module):
    """Pools only up to the batch's longest sequence: ``int(lengths.max())`` becomes a slice bound."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n = int(lengths.max())
        return self.lin(x[:, :n]).tanh().mean(1)


class StateRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out * 2 if self.lin.weight.sum() > 0 else out


class Configured(nn.Module):
    """Sets a config field at its first call (as ViT sets config.problem_type), and a flag to the
    value it already has at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.config = SimpleNamespace(problem_type=None)
        self.ready = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "regression"
        self.ready = True
        return self.lin(x)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def _lengths(i: int, device: str) -> torch.Tensor:
    return torch.tensor([3, 5] if i % 2 else [5, 6], device=device)


def _captured_run(model, device, backend, steps, make, unsafe=()):
    twin = copy.deepcopy(model)
    rk.capture(model, backend=backend, unsafe_disable=unsafe)
    same = True
    for i in range(steps):
        args = make(i)
        out, ref = model(*args), twin(*args)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        same &= torch.equal(out, ref)
    grads = all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    return same and grads, rk.recorder_of(model)


def test_a_length_read_from_the_inputs_keys_the_recording(backend, device):
    torch.manual_seed(0)
    model = Lengths().to(device)

    def make(i):
        return torch.randn(2, 6, 4, device=device), _lengths(i, device)

    same, rec = _captured_run(model, device, backend, 6, make)
    assert same, rec.journal.format()
    assert rec.counts["record"] == 2 and rec.counts["replay"] == 4 and not rec.retired, (
        rec.summary()
    )


def test_a_length_read_unkeyed_replays_the_first_length():
    torch.manual_seed(0)

    def make(i):
        return torch.randn(2, 6, 4), _lengths(i, "cpu")

    same, rec = _captured_run(
        Lengths(), "cpu", "emulated", 4, make, unsafe=negative_control("input_reads")
    )
    assert not same, rec.summary()


@pytest.mark.parametrize("lengths_on", ["device", "cpu"])
def test_a_length_read_keys_a_whole_step(backend, device, lengths_on):
    """``cpu``: the lengths stay on the CPU (a collate function's) beside a batch on the device; a
    host read of a CPU tensor does not fail a CUDA capture, so such a call is watched from its first
    capture (a GPU-only call is captured unwatched until a capture fails)."""
    torch.manual_seed(0)
    model = Lengths().to(device)
    twin = copy.deepcopy(model)

    def opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m, x, lengths):
        return m(x, lengths).pow(2).mean()

    step = rk.TrainStep(model, loss_fn, opt(model), backend=backend, accumulate=2)
    eager = rk.TrainStep(twin, loss_fn, opt(twin), replay=False, accumulate=2)
    for i in range(10):
        x = torch.randn(2, 6, 4, device=device)
        lengths = _lengths(i // 2, device if lengths_on == "device" else "cpu")
        assert torch.equal(step(x, lengths), eager(x, lengths)), step.journal.format()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    assert step.counts["replay"] >= 4 and not step.retired, step.summary()


@pytest.mark.parametrize("api", ["capture", "step"])
def test_a_read_of_the_model_state_still_retires(api):
    model = StateRead()
    if api == "capture":
        rec = rk.capture(model, backend="emulated")
        model(torch.randn(2, 4)).sum().backward()
    else:
        rec = rk.TrainStep(
            model,
            lambda m, x: m(x).sum(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            backend="emulated",
            warmup=0,
        )
        rec(torch.randn(2, 4))
    assert rec.retired and "_local_scalar_dense" in rec.retire_reason, rec.summary()


def test_a_write_made_at_the_first_call_runs_it_eagerly_then_replays(backend, device):
    torch.manual_seed(0)
    model = Configured().to(device)
    same, rec = _captured_run(
        model, device, backend, 4, lambda i: (torch.randn(3, 4, device=device),)
    )
    assert same and model.config.problem_type == "regression", rec.journal.format()
    assert dict(rec.eager_reasons) == {"first_write": 1} and rec.counts["replay"] == 2, (
        rec.summary()
    )


def test_a_write_at_every_call_still_retires():
    model = Counter()
    same, rec = _captured_run(model, "cpu", "emulated", 3, lambda i: (torch.randn(3, 4),))
    assert same and model.calls == 3 and rec.retired and "calls" in rec.retire_reason, rec.summary()


class Prefix(nn.Module):
    """Reads its argument itself on the host: ``int(k)`` of a 0-d input is the slice bound."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, : int(k)])


def test_a_read_of_an_argument_itself_keys_the_recording():
    """The read's program is the argument alone (no aten call made it): it is evaluated per call."""
    torch.manual_seed(0)
    model = Prefix()
    same, rec = _captured_run(
        model, "cpu", "emulated", 6, lambda i: (torch.randn(2, 5, 4), torch.tensor(2 + i % 2))
    )
    assert same and not rec.retired, rec.journal.format()
    assert rec.counts["replay"] >= 2, rec.journal.format()


class InverseOrder(nn.Module):
    """Slices at a bound read from an inverse permutation built as ``invert_permutation`` builds
    it (an empty tensor filled in place), on the device of the order it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        inverse = torch.empty_like(order)
        inverse.scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return self.lin(x[:, : 1 + int(inverse[0])])


def test_a_read_of_an_input_derived_tensor_filled_in_place_keys_the_recording(backend, device):
    """The filled tensor is input-derived: its read keys the recording (it read as state before
    and retired); each order gets a recording of its own."""
    torch.manual_seed(0)

    def make(i):
        order = torch.tensor([2, 0, 1] if i % 2 else [1, 2, 0], device=device)
        return torch.randn(2, 5, 4, device=device), order

    same, rec = _captured_run(InverseOrder().to(device), device, backend, 6, make)
    assert same and not rec.retired, rec.journal.format()
    assert rec.counts["record"] == 2 and rec.counts["replay"] == 4, rec.summary()


class RandomRows(nn.Module):
    """Scales by how many rows a coin keeps: an empty tensor filled by a draw, read on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        keep = torch.empty_like(idx, dtype=torch.float32).bernoulli_(0.5)
        return self.lin(x) * (int(keep.sum()) + 1)


def _drawing_run(backend, device, replay):
    """Six steps from one seed: the losses, the parameters and torch's CPU generator after each."""
    torch.manual_seed(0)
    model = RandomRows().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = rk.capture(model, backend=backend) if replay else None
    torch.manual_seed(3)
    seen = []
    for _ in range(6):
        loss = model(torch.randn(3, 4, device=device), torch.arange(4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append((loss.detach(), *(p.detach().clone() for p in model.parameters())))
        seen.append((torch.get_rng_state(),))
    return seen, rec


def test_an_empty_tensor_filled_by_a_draw_is_not_input_derived(backend, device):
    """The draw is no function of the inputs: its read stays a read of state (the call retires,
    exact); evaluated as a program it would draw again before each call and key by that draw."""
    eager, _ = _drawing_run(backend, device, False)
    seen, rec = _drawing_run(backend, device, True)
    assert all(
        torch.equal(a, b)
        for x, y in zip(eager, seen, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert rec.counts["replay"] == 0, rec.summary()


class StateThenFill(nn.Module):
    """An empty tensor written first with the model's state (an ``out=`` result), then partly
    filled from the inputs: its values are the state's where the fill did not reach."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.tensor([3, 1, 2]))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        t = torch.empty_like(idx)
        torch.add(self.offset, 0, out=t)
        t.index_fill_(0, idx[:1], 0)
        return self.lin(x[:, : 1 + int(t.sum())])


def test_a_fill_after_a_write_of_state_is_not_input_derived(backend, device):
    """The read is of state (it retires): were the tensor input-derived, a call would evaluate its
    program from a new empty tensor and key by values eager never read."""
    torch.manual_seed(0)
    model = StateThenFill().to(device)

    def make(i):
        return torch.randn(2, 8, 4, device=device), torch.tensor([i % 3, 0, 1], device=device)

    same, rec = _captured_run(model, device, backend, 4, make)
    assert same and rec.retired, rec.journal.format()
