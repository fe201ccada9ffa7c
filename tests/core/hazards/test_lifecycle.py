"""Lifecycle and concurrency: garbage collection, pickling, interrupts, threads, nested captures, in-place weights."""

from __future__ import annotations

import gc
import io
import pickle
import threading
import weakref

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards.pattern import MLP

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("lifecycle"))
def test_lifecycle_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("lifecycle"))
def test_without_the_guard_lifecycle_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


def _train(model: nn.Module, device: str, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 6, device=device)).pow(2).mean().backward()
        opt.step()


def test_a_dropped_captured_module_is_garbage_collected(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = MLP(bn=True).to(device)
    rec = rk.capture(model, backend=backend)
    _train(model, device)
    assert rec.counts["replay"] >= 1
    module_ref, recorder_ref = weakref.ref(model), weakref.ref(rec)
    del model, rec
    gc.collect()
    assert module_ref() is None
    assert recorder_ref() is None


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_captured_module_saves_as_a_plain_module(backend: str, device: str, how: str) -> None:
    torch.manual_seed(0)
    model = MLP(bn=True).to(device)
    rec = rk.capture(model, backend=backend)
    try:
        _train(model, device)
        if how == "pickle":
            loaded = pickle.loads(pickle.dumps(model))
        else:
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
        assert rk.recorder_of(loaded) is None
        assert (
            loaded.forward.__func__ is type(loaded).forward
        )  # the class's own forward, no routing
        x = torch.randn(4, 6, device=device)
        with torch.no_grad():  # the captured one routes eager under no_grad: plain module outputs
            assert torch.equal(loaded(x), model(x))
        loaded.train()
        rk.capture(loaded, backend=backend).release()  # the copy can be captured on its own
    finally:
        rec.release()


_RUNS: dict[
    int, int
] = {}  # counted outside the module: an assigned attribute would be a side effect


class Interrupting(nn.Module):
    """Raises KeyboardInterrupt on the ``interrupt_at``-th run of its forward (Ctrl-C mid warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(bn=True, p=0.3)
        self.interrupt_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runs = _RUNS[id(self)] = _RUNS.get(id(self), 0) + 1
        out = self.net(x)
        if runs == self.interrupt_at:
            raise KeyboardInterrupt
        return out


def test_an_interrupt_during_warm_up_leaves_state_as_it_was(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model, twin = Interrupting().to(device), Interrupting().to(device)
    twin.load_state_dict(model.state_dict())
    rec = rk.capture(model, backend=backend)
    try:
        model.interrupt_at = 2  # the first call records: its second forward run is inside warm-up
        x = torch.randn(4, 6, device=device)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        rng = torch.get_rng_state()
        with pytest.raises(KeyboardInterrupt):
            model(x)
        for n, b in model.named_buffers():
            assert torch.equal(b, buffers[n]), n
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(p.grad is None for p in model.parameters())
        model.interrupt_at = None
        torch.manual_seed(1)
        _train(model, device)  # the recorder is usable and training ends like eager
        torch.manual_seed(1)
        _train(twin, device)
        for (n, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
            assert torch.equal(a, b), n
    finally:
        rec.release()


def test_a_call_from_another_thread_routes_eager(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = MLP().to(device)
    rec = rk.capture(model, backend=backend)
    try:
        _train(model, device, steps=2)  # record and replay in this thread
        assert rec.counts["replay"] >= 1
        errors: list[BaseException] = []

        def other() -> None:
            try:
                _train(model, device, steps=1)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert not errors
        assert rec.eager_reasons.get("thread", 0) == 1, rec.journal.format()
    finally:
        rec.release()


def test_two_threads_training_concurrently_get_eager_values(backend: str, device: str) -> None:
    """Each thread's gradients equal eager's for its inputs, or a clear ReplayError; nothing silent.

    The parameters are taken once, as an optimizer holds them: while the owner thread records, the
    tree's ``_parameters`` hold stand-ins for a moment, and ``model.parameters()`` read then by
    another thread returns those (a torch error in that thread, not a silent value; README, Threads).
    """
    torch.manual_seed(0)
    model, twin = MLP().to(device), MLP().to(device)
    twin.load_state_dict(model.state_dict())
    params = list(model.parameters())
    rec = rk.capture(model, backend=backend)
    inputs = [[torch.randn(4, 6, device=device) for _ in range(6)] for _ in range(2)]
    results: list[list[tuple[torch.Tensor, ...] | None]] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(k: int) -> None:
        try:
            start.wait()
            for x in inputs[k]:
                try:
                    out = model(x)
                    results[k].append(torch.autograd.grad(out.pow(2).sum(), params))
                except rk.ReplayError:
                    results[k].append(None)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for k in range(2):
            for x, got in zip(inputs[k], results[k], strict=True):
                if got is None:
                    continue
                ref = torch.autograd.grad(twin(x).pow(2).sum(), list(twin.parameters()))
                for a, b in zip(got, ref, strict=True):
                    assert torch.equal(a, b)
    finally:
        rec.release()


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x) * 2


@pytest.mark.parametrize("order", ["parent_first", "child_first"])
def test_capturing_a_parent_and_its_child_is_refused(backend: str, device: str, order: str) -> None:
    model = Parent().to(device)
    first, second = (model, model.child) if order == "parent_first" else (model.child, model)
    rec = rk.capture(first, backend=backend)
    try:
        with pytest.raises(rk.ReplayError):
            rk.capture(second, backend=backend).release()
    finally:
        rec.release()


def test_weights_changed_in_place_before_backward_raise_like_eager(
    backend: str, device: str
) -> None:
    torch.manual_seed(0)
    model = MLP().to(device)
    rec = rk.capture(model, backend=backend)
    try:
        _train(model, device, steps=2)
        loss = model(torch.randn(4, 6, device=device)).pow(2).mean()
        with torch.no_grad():
            model.fc2.weight.mul_(0.5)
        with pytest.raises(RuntimeError, match=r"inplace|in place|in-place"):
            loss.backward()
    finally:
        rec.release()
