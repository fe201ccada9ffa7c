"""Review of the in-pool reference step (backends/scratch.py): what a recording call's eager
reference leaves in the recordings' pool must free the earlier recordings, however it ends.

The step trains over three lengths (shape buckets); the forward multiplies by a per-length table
from a global ``lru_cache``, made at the length's first call: inside a reference step once
recordings exist. Each test compares losses and parameters with the eager twin, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.verify.bitwise import diff_states


@functools.cache
def _table(n: int, device: str) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n, device=device).unsqueeze(1)


class _Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * _table(x.shape[0], x.device.type)


def _checked_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = m(x)  # the table for this length is made here, before the check
    if bool((y < 0).any()):  # a data check that rejects a bad batch, after the forward
        raise ValueError("negative label")
    return nn.functional.cross_entropy(out, y)


def _skip_bad_batches(
    replay: bool, device: str, backend: str, unsafe: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor | None], rk.TrainStep]:
    """A loop that skips the batch its loss_fn rejects; the first length-12 batch is bad."""
    _table.cache_clear()
    torch.manual_seed(0)
    model = _Positions().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(
        model,
        _checked_loss,
        opt,
        replay=replay,
        backend=backend,
        warmup=1,
        unsafe_disable=unsafe,
    )
    g = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor | None] = {}
    try:
        for i, n in enumerate([4, 8, 4, 8, 12, 4, 8, 12, 4, 12]):
            x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
            if i == 4:
                y[0] = -1
            try:
                state[f"loss{i}"] = step(x.to(device), y.to(device)).detach()
            except ValueError:
                state[f"loss{i}"] = None
    finally:
        step.release()
    state |= {f"param/{k}": p.detach() for k, p in model.named_parameters()}
    return state, step


def test_a_reference_step_that_raises_still_frees_what_its_leftovers_endanger(
    backend: str, device: str
):
    """The rejected batch's reference step made the length-12 table in the pool and raised: the
    earlier recordings' replays may overwrite it, so they are freed as when it returns."""
    eager, _ = _skip_bad_batches(False, device, backend)
    replayed, step = _skip_bad_batches(True, device, backend)
    assert diff_states(eager, replayed) == [], step.journal.format()
    assert step.counts["replay"] > 0
    if backend == "emulated":  # CUDA: the table may sit beside the pool (allocator's choice)
        assert any(e.reason == "pool_survivors" for e in step.journal), step.journal.format()


def test_without_pool_survivors_a_raising_reference_step_differs():
    """The negative control: the table the raising reference left is overwritten by a replay."""
    eager, _ = _skip_bad_batches(False, "cpu", "emulated")
    replayed, _ = _skip_bad_batches(True, "cpu", "emulated", unsafe=("pool_survivors",))
    assert diff_states(eager, replayed) != []


def _view_of_inference_tensor(n: int, device: str) -> torch.Tensor:
    with torch.inference_mode():  # an inference tensor's view holds no base tensor
        return torch.linspace(0.5, 1.5, n, device=device)[:, None]


def _from_data(n: int, device: str) -> torch.Tensor:
    return torch.tensor([[0.5 + i / n] for i in range(n)], device=device)


def _detached(n: int, device: str) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n, device=device).unsqueeze(1).detach()


TABLES: dict[str, Callable[[int, str], torch.Tensor]] = {
    "inference_view": _view_of_inference_tensor,
    "from_data": _from_data,
    "detached": _detached,
}


def _three_lengths(
    step: rk.TrainStep, model: nn.Module, device: str
) -> dict[str, torch.Tensor | None]:
    """Batches of 4, 8 and 12 rows interleaved through ``step`` (released after): losses and parameters."""
    g = torch.Generator().manual_seed(3)
    try:
        state: dict[str, torch.Tensor | None] = {
            f"loss{i}": step(torch.randn(n, 6, generator=g).to(device)).detach()
            for i, n in enumerate([4, 8, 4, 8, 12, 4, 8, 12, 4])
        }
    finally:
        step.release()
    return state | {f"param/{k}": p.detach() for k, p in model.named_parameters()}


def _buckets(
    make: Callable[[int, str], torch.Tensor],
    replay: bool,
    device: str,
    backend: str,
    unsafe: tuple[str, ...] = (),
) -> tuple[dict[str, torch.Tensor | None], rk.TrainStep]:
    """Three lengths; each length's table is cached globally at its first call."""
    table = functools.cache(make)
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) + table(x.shape[0], x.device.type)).pow(2).mean()  # add: saves no table

    step = rk.TrainStep(
        model, loss_fn, opt, replay=replay, backend=backend, warmup=1, unsafe_disable=unsafe
    )
    state = _three_lengths(step, model, device)
    return state, step


@pytest.mark.parametrize("made", sorted(TABLES))
def test_a_cached_table_however_made_frees_the_earlier_recordings(
    backend: str, device: str, made: str
):
    """The emulated tracker sees a survivor as a CUDA pool does (its memory, not its tensor
    object): a view of an inference tensor, ``detach()`` and ``torch.tensor(data)``."""
    eager, _ = _buckets(TABLES[made], False, device, backend)
    replayed, step = _buckets(TABLES[made], True, device, backend)
    assert diff_states(eager, replayed) == [], step.journal.format()
    assert step.counts["replay"] > 0
    if backend == "emulated":
        assert any(e.reason == "pool_survivors" for e in step.journal), step.journal.format()


@pytest.mark.parametrize("made", sorted(TABLES))
def test_without_pool_survivors_a_cached_table_however_made_differs(made: str):
    eager, _ = _buckets(TABLES[made], False, "cpu", "emulated")
    replayed, _ = _buckets(TABLES[made], True, "cpu", "emulated", unsafe=("pool_survivors",))
    assert diff_states(eager, replayed) != []


class _TwoSequences(nn.Module):
    """A batch packed as two sequences of a nested jagged tensor (a wrapper subclass)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        offsets = torch.tensor([0, n // 2, n], device=x.device)
        packed = torch.nested.nested_tensor_from_jagged(self.lin(x), offsets)
        return nn.functional.gelu(packed).values()


def _nested(replay: bool) -> tuple[dict[str, torch.Tensor | None], rk.TrainStep]:
    torch.manual_seed(0)
    model = _TwoSequences()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x), y)

    step = rk.TrainStep(model, loss_fn, opt, replay=replay, backend="emulated", warmup=1)
    g = torch.Generator().manual_seed(3)
    try:
        state: dict[str, torch.Tensor | None] = {
            f"loss{i}": step(
                torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
            ).detach()
            for i, n in enumerate([4, 8, 4, 8, 12, 4, 8, 12])
        }
    finally:
        step.release()
    state |= {f"param/{k}": p.detach() for k, p in model.named_parameters()}
    return state, step


def test_a_nested_jagged_forward_records_a_second_bucket_and_replays_like_eager():
    """The emulated reference step's tracker reads storages through a wrapper subclass's inner
    tensors (it raised on the subclass), and the tape replays ops on meta tensors (the nested
    sizes) without asking autocast about 'meta'."""
    eager, _ = _nested(False)
    replayed, step = _nested(True)
    assert diff_states(eager, replayed) == [], step.journal.format()
    assert step.counts["replay"] > 0


def _running_mean(
    replay: bool, device: str, backend: str, unsafe: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor | None], rk.TrainStep]:
    """loss_fn keeps a running mean of the loss in a tensor of the training script (in place)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    running = torch.zeros((), device=device)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).pow(2).mean()
        with torch.no_grad():
            running.mul_(0.9).add_(loss, alpha=0.1)
        return loss

    step = rk.TrainStep(
        model, loss_fn, opt, replay=replay, backend=backend, warmup=1, unsafe_disable=unsafe
    )
    state = _three_lengths(step, model, device)
    state["running"] = running
    return state, step


def test_a_tensor_loss_fn_writes_in_place_is_written_once_per_recording_call(
    backend: str, device: str
):
    """The recording call ran loss_fn twice (its reference step and its capture) and put back only
    the model's and optimizer's state: the running mean took two updates there. The first such
    call stands as eager's; later snapshots keep the tensor and put it back."""
    eager, _ = _running_mean(False, device, backend)
    replayed, step = _running_mean(True, device, backend)
    assert diff_states(eager, replayed) == [], step.journal.format()
    assert step.counts["replay"] > 0
    assert any(e.reason == "held_writes" for e in step.journal), step.journal.format()


def test_without_loss_inputs_a_tensor_loss_fn_writes_differs():
    eager, _ = _running_mean(False, "cpu", "emulated")
    replayed, _ = _running_mean(True, "cpu", "emulated", unsafe=("loss_inputs",))
    assert [d.name for d in diff_states(eager, replayed)] == ["running"]


_SEEN = torch.zeros(())  # a module-level counter the forward below writes


class _CountsRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            _SEEN.add_(x.shape[0])  # rows seen, in a global tensor (not the model's)
        return self.lin(x)


def test_a_global_tensor_the_forward_writes_is_written_once_per_recording_call():
    """Once a known limit (review5): the call state now puts back what the recording call's extra
    run wrote into a tensor the forward names through its globals."""

    def train(replay: bool) -> torch.Tensor:
        torch.manual_seed(0)
        _SEEN.zero_()
        model = _CountsRows()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = rk.TrainStep(
            model,
            lambda m, x: m(x).pow(2).mean(),
            opt,
            replay=replay,
            backend="emulated",
            warmup=1,
        )
        g = torch.Generator().manual_seed(0)
        for n in [4, 8, 4, 8, 12, 4]:
            step(torch.randn(n, 6, generator=g))
        step.release()
        return _SEEN.clone()

    assert torch.equal(train(False), train(True))
