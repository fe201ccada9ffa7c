"""State a rerun must find as the first run found it (from a hostile review).

A recording call runs the body more than once: eager's half of the verification, the capture,
a capture again after an input-derived host read was learnt, the twin after a refusal. Each rerun
starts from a snapshot; what the snapshot misses is changed twice, silently. Every test compares
with the same code run eagerly.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

import replaykit as rk


class _Held(nn.Module):
    """Keeps a running sum in a tensor held in a list attribute, written in place by the forward."""

    def __init__(self, foreach: bool) -> None:
        super().__init__()
        self.lin, self.foreach = nn.Linear(4, 2), foreach
        self.held = [torch.zeros(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.foreach:
            torch._foreach_add_(self.held, [x.detach().sum(0)])
        else:
            self.held[0].add_(x.detach().sum(0))
        return self.lin(x * self.held[0])


class _Noisy(nn.Module):
    """Draws input noise from a private generator it holds (refused by a replay: the step retires)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + 0.1 * torch.randn(x.shape, generator=self.gen))


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (m(x) - y).pow(2).mean()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]


def _captured_beside_eager(model: nn.Module) -> tuple[nn.Module, Any]:
    """Train ``model`` captured and an eager copy on the same batches, outputs equal at each
    call; returns the copy, for the end-state comparison, and the recorder."""
    twin = copy.deepcopy(model)
    rec = rk.capture(model, backend="emulated")
    for x, y in _batches(5):
        out, ref = model(x), twin(x)
        assert torch.equal(out, ref), rec.journal.format()
        (out - y).pow(2).mean().backward()
        (ref - y).pow(2).mean().backward()
    return twin, rec


def _steps_match(model: nn.Module, loss_fn, accumulate: int = 1, twin_loss_fn=None) -> rk.TrainStep:
    torch.manual_seed(0)
    twin = copy.deepcopy(model)
    opt, opt_t = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    step = rk.TrainStep(model, loss_fn, opt, backend="emulated", accumulate=accumulate)
    eager = rk.TrainStep(twin, twin_loss_fn or loss_fn, opt_t, replay=False, accumulate=accumulate)
    for i, batch in enumerate(_batches(8)):
        assert torch.equal(step(*batch), eager(*batch)), (i, step.journal.format())
        for (name, a), b in zip(
            model.state_dict().items(), twin.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (i, name, step.journal.format())
    return step


@pytest.mark.parametrize("foreach", [False, True], ids=["add_", "foreach_add_"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_tensor_held_in_a_list_and_written_in_place_keeps_parity(
    foreach: bool, accumulate: int
) -> None:
    """The snapshot put back the list, not its tensor's values: verification's eager half and the
    capture both added to it, the recording diverged, and the twin rerun added a third time."""
    model = _Held(foreach)
    step = _steps_match(model, _loss, accumulate)
    assert step.counts["replay"] > 0 and not step.retired, step.summary()


@pytest.mark.parametrize("foreach", [False, True], ids=["add_", "foreach_add_"])
def test_a_tensor_held_in_a_list_keeps_parity_under_capture(foreach: bool) -> None:
    torch.manual_seed(0)
    model = _Held(foreach)
    twin, rec = _captured_beside_eager(model)
    assert torch.equal(model.held[0], twin.held[0])
    assert all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    assert rec.counts["replay"] > 0, rec.summary()


def test_a_generator_held_by_the_model_draws_as_eager_when_the_step_retires() -> None:
    """Eager's half of the verification ran before the capture: the private generator advanced
    twice for one call (three times while a refused capture was retried watched)."""
    step = _steps_match(_Noisy(), _loss)
    assert step.retired and "private torch.Generator" in step.retire_reason, step.summary()


def test_a_generator_loss_fn_closes_over_draws_as_eager() -> None:
    """Found where loss_fn's host values are (its closure), and put back with the step's state."""

    def noisy(gen: torch.Generator):
        def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return (m(x + 0.1 * torch.randn(x.shape, generator=gen)) - y).pow(2).mean()

        return loss_fn

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    _steps_match(
        model,
        noisy(torch.Generator().manual_seed(7)),
        twin_loss_fn=noisy(torch.Generator().manual_seed(7)),
    )


def test_host_reads_on_some_batches_only_replay_bitwise() -> None:
    """Input-derived reads are learnt as they appear and keyed; a second read made only when the
    first answers True is learnt at a later batch."""

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        loss = (m(x) - y).pow(2).mean()
        if flag.any():
            loss = loss * (2 if (flag > 1).all() else 3)
        return loss

    flags = [[0, 0], [0, 0], [0, 1], [2, 2], [0, 0], [1, 3], [2, 3], [0, 1]] * 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    opt, opt_t = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    step = rk.TrainStep(model, loss_fn, opt, backend="emulated", accumulate=2)
    eager = rk.TrainStep(twin, loss_fn, opt_t, replay=False, accumulate=2)
    for i, ((x, y), f) in enumerate(zip(_batches(16) + _batches(16), flags, strict=False)):
        flag = torch.tensor(f)
        torch.manual_seed(i)
        loss = step(x, y, flag)
        torch.manual_seed(i)
        assert torch.equal(loss, eager(x, y, flag)), (i, step.journal.format())
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )
    assert step.counts["replay"] >= 6 and not step.retired, step.summary()


class _Decaying(nn.Module):
    """Shrinks its own weights in place at each forward (a non-idempotent write into parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for p in self.lin.parameters():
                p.mul_(0.999)
        return self.out(self.lin(x).relu())


def test_a_forward_writing_its_parameters_ends_like_eager_under_capture() -> None:
    """The verification's eager forward runs on stand-ins sharing the parameters' storage: the
    parameters the probe saw written are kept and put back, or the write is made twice."""
    torch.manual_seed(0)
    model = _Decaying()
    twin = copy.deepcopy(model)
    rec = rk.capture(model, backend="emulated")
    opt, opt_t = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
    for x, y in _batches(4):
        (model(x) - y).pow(2).mean().backward()
        (twin(x) - y).pow(2).mean().backward()
        opt.step(), opt_t.step(), opt.zero_grad(), opt_t.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), (name, rec.journal.format())
    assert rec.counts["replay"] == 3, rec.journal.format()


def test_a_forward_writing_its_parameters_is_verified_once() -> None:
    """The rerun at the backward was skipped for ever (the parameters' versions had moved since
    the shadow began), so the gradients were never compared and every replay ran eager's forward
    again as a new check."""
    torch.manual_seed(0)
    model = _Decaying()
    rec = rk.capture(model, backend="emulated")
    for x, y in _batches(4):
        (model(x) - y).pow(2).mean().backward()
    checks = [(e.call, e.reason, e.detail) for e in rec.journal if e.kind == "check"]
    assert checks == [(1, "forward", None), (1, "backward", None)], rec.journal.format()
    assert rec.counts["replay"] == 3, rec.journal.format()


class _MomentumEncoder(nn.Module):
    """MoCo / BYOL / DINO: a frozen key encoder follows the query encoder inside the forward, and a
    queue of keys is rolled in a buffer."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(4, 4), nn.Linear(8, 2)
        self.k = nn.Linear(4, 4).requires_grad_(False)
        self.through_data = through_data
        self.register_buffer("queue", torch.zeros(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_data:  # the old idiom: .data has a version counter of its own
            for pk, pq in zip(self.k.parameters(), self.q.parameters(), strict=True):
                pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
        else:
            with torch.no_grad():
                for pk, pq in zip(self.k.parameters(), self.q.parameters(), strict=True):
                    pk.lerp_(pq, 0.1)
        with torch.no_grad():
            self.queue.copy_(torch.roll(self.queue, 1, 1))
            self.queue[:, 0] = self.k(x).mean(0)
        q = self.q(x)
        return self.out(torch.cat([q, (q @ self.queue)[:, :4]], 1))


@pytest.mark.parametrize("through_data", [False, True], ids=["no_grad", "data"])
def test_a_forward_updating_a_frozen_encoder_ends_like_eager_under_capture(
    through_data: bool,
) -> None:
    """Frozen parameters have no stand-ins: the verification's eager forward wrote them for real
    and nothing put them back, so the first replay wrote them a second time (off eager for good)."""
    torch.manual_seed(0)
    model = _MomentumEncoder(through_data)
    twin = copy.deepcopy(model)
    rec = rk.capture(model, backend="emulated")
    opt, opt_t = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
    for x, y in _batches(4):
        out, ref = model(x), twin(x)
        assert torch.equal(out, ref), rec.journal.format()
        (out - y).pow(2).mean().backward()
        (ref - y).pow(2).mean().backward()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            assert p.grad is None or torch.equal(p.grad, q.grad), rec.journal.format()
        opt.step(), opt_t.step(), opt.zero_grad(), opt_t.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), (name, rec.journal.format())
    assert rec.counts["replay"] == 3, rec.journal.format()


class _Bank:
    """A plain object the model holds: a queue of keys and a running sum."""

    def __init__(self) -> None:
        self.queue, self.stats = torch.zeros(4, 6), {"sum": [torch.zeros(4)]}


class _Banked(nn.Module):
    """Writes tensors held deeper than a list attribute: in a plain object, in a dict's list."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bank = nn.Linear(4, 2), _Bank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.bank.queue.copy_(torch.roll(self.bank.queue, 1, 1))
            self.bank.queue[:, 0] = x.mean(0)
            self.bank.stats["sum"][0].add_(x.sum(0))
        return self.lin(x * self.bank.stats["sum"][0] + self.bank.queue.sum(1))


class _Augment:
    """A callable augmentation object holding its own generator."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn(x.shape, generator=self.gen)


class _Augmented(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.aug = nn.Linear(4, 2), _Augment()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.aug(x))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_tensors_held_in_a_plain_object_keep_parity(accumulate: int) -> None:
    step = _steps_match(_Banked(), _loss, accumulate)
    assert step.counts["replay"] > 0 and not step.retired, step.summary()


def test_tensors_held_in_a_plain_object_keep_parity_under_capture() -> None:
    torch.manual_seed(0)
    model = _Banked()
    twin, rec = _captured_beside_eager(model)
    assert torch.equal(model.bank.queue, twin.bank.queue)
    assert torch.equal(model.bank.stats["sum"][0], twin.bank.stats["sum"][0])
    assert rec.counts["replay"] > 0, rec.summary()


def test_a_generator_held_by_an_object_of_the_model_draws_as_eager() -> None:
    step = _steps_match(_Augmented(), _loss)
    assert step.retired and "private torch.Generator" in step.retire_reason, step.summary()


def _default_argument():
    def loss_fn(m, x, y, gen=torch.Generator().manual_seed(7)):  # noqa: B008 - the pattern tested
        return (m(x + 0.1 * torch.randn(x.shape, generator=gen)) - y).pow(2).mean()

    return loss_fn


def _partial():
    def loss_fn(m, x, y, gen):
        return (m(x + 0.1 * torch.randn(x.shape, generator=gen)) - y).pow(2).mean()

    return functools.partial(loss_fn, gen=torch.Generator().manual_seed(7))


class _Criterion:
    def __init__(self) -> None:
        self.gens = {"noise": torch.Generator().manual_seed(7)}

    def __call__(self, m, x, y):
        return (m(x + 0.1 * torch.randn(x.shape, generator=self.gens["noise"])) - y).pow(2).mean()


def _closed_over_object():
    held = _Criterion()

    def loss_fn(m, x, y):
        return held(m, x, y)

    return loss_fn


@pytest.mark.parametrize(
    "make", [_default_argument, _partial, _Criterion, _closed_over_object], ids=lambda f: f.__name__
)
def test_a_generator_loss_fn_reaches_draws_as_eager(make) -> None:
    """Found in what loss_fn's sources hold, not only a closure cell holding it directly."""
    torch.manual_seed(0)
    step = _steps_match(nn.Linear(4, 2), make(), twin_loss_fn=make())
    assert step.retired and "private torch.Generator" in step.retire_reason, step.summary()
