"""Recurrent nets (nn.LSTM, nn.GRU, nn.RNN): captured they replay (their flat-weight cache follows the
stand-ins), packed sequences key the recording by their lengths (read on the host inside the packing
kernel), and on CUDA cuDNN's private dropout state is never advanced by a recording call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import replaykit as rk
from replaykit.protections import negative_control
from replaykit.verify.snapshot import StateSnapshot

KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
T, F, H = 5, 3, 6


class Tagger(nn.Module):
    """A recurrent encoder and a per-step head; ``packing`` packs the padded batch by its lengths."""

    def __init__(self, kind: str = "lstm", packing: str = "", **kw: object) -> None:
        super().__init__()
        self.rnn = KINDS[kind](F, H, batch_first=True, **kw)
        self.head = nn.Linear(H * (2 if kw.get("bidirectional") else 1), 2)
        self.packing = packing

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if not self.packing:
            return self.head(self.rnn(x)[0])
        packed = pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=self.packing == "sorted"
        )
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=T)
        return self.head(out)


def _loss(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    return model(*batch).pow(2).mean()


def _batches(n: int, packing: str = "", device: str = "cpu") -> list[tuple[torch.Tensor, ...]]:
    """Random batches; packed ones cycle through two length patterns (so a key recurs)."""
    g = torch.Generator().manual_seed(7)
    patterns = [torch.tensor([5, 3, 4, 1]), torch.tensor([2, 5, 5, 3])]
    out = []
    for i in range(n):
        x = torch.randn(4, T, F, generator=g).to(device)
        if not packing:
            out.append((x,))
            continue
        lengths = patterns[i % 2]
        out.append((x, lengths.sort(descending=True).values if packing == "sorted" else lengths))
    return out


def _train(
    make: Callable[[], nn.Module], batches: list, wrap: str, device: str = "cpu", **kw: object
) -> tuple[dict[str, torch.Tensor], object]:
    """Trains from seed 0: plain eager, under ``rk.capture`` or through ``rk.TrainStep``."""
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backend = "cuda" if device == "cuda" else "emulated"
    runner: object = None
    if wrap == "step":
        runner = rk.TrainStep(model, _loss, opt, backend=backend, **kw)
        for b in batches:
            runner(*b)
    else:
        if wrap == "capture":
            runner = rk.capture(model, backend=backend, warmup=1, **kw)
        for b in batches:
            opt.zero_grad(set_to_none=True)
            _loss(model, *b).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, runner


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("lstm", {"num_layers": 2, "dropout": 0.2}),
        ("gru", {"bidirectional": True}),
        ("rnn", {}),
        ("lstm", {"proj_size": 4}),
    ],
)
def test_a_captured_recurrent_net_replays_and_ends_like_eager(kind: str, kw: dict) -> None:
    def make() -> nn.Module:
        return Tagger(kind, **kw)

    if "proj_size" in kw:  # the head reads the projection
        make = lambda: _with_head(Tagger(kind, **kw), kw["proj_size"])  # noqa: E731
    batches = _batches(5)
    eager, _ = _train(make, batches, "eager")
    replayed, rec = _train(make, batches, "capture")
    assert _equal(eager, replayed)
    assert rec.counts["replay"] >= 3, (
        rec.journal.format()
    )  # it used to retire: "forward assigns _flat_weights"
    assert not rec.retired


def _with_head(model: Tagger, width: int) -> Tagger:
    model.head = nn.Linear(width, 2)
    return model


@pytest.mark.parametrize("packing", ["sorted", "unsorted"])
@pytest.mark.parametrize("wrap", ["step", "capture"])
def test_packed_sequences_are_keyed_by_their_lengths(wrap: str, packing: str) -> None:
    """The packing kernel reads the lengths on the host: each length pattern gets its recording."""
    batches = _batches(6, packing)
    eager, _ = _train(lambda: Tagger("gru", packing), batches, "eager")
    replayed, runner = _train(lambda: Tagger("gru", packing), batches, wrap)
    assert _equal(eager, replayed)
    assert runner.counts["replay"] >= 2, runner.journal.format()
    assert not runner.retired


def test_without_the_input_read_key_packed_sequences_break() -> None:
    """The negative control: the first lengths frozen into the recording, later batches crash or differ."""
    batches = _batches(6, "sorted")
    eager, _ = _train(lambda: Tagger("lstm", "sorted"), batches, "eager")
    try:
        replayed, _ = _train(
            lambda: Tagger("lstm", "sorted"),
            batches,
            "step",
            unsafe_disable=negative_control("input_reads"),
        )
    except RuntimeError as e:
        assert not isinstance(e, rk.ReplayError)
        return
    assert not _equal(eager, replayed)


def test_a_recurrent_net_in_eval_between_steps_ends_like_eager() -> None:
    """Validation in eval mode between steps: routed eager (no_grad), the training calls replay."""
    torch.manual_seed(0)
    results = []
    for wrap in ("eager", "capture"):
        torch.manual_seed(0)
        model = Tagger("lstm", num_layers=2, dropout=0.3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = rk.capture(model, backend="emulated", warmup=1) if wrap == "capture" else None
        for (x,) in _batches(5):
            opt.zero_grad(set_to_none=True)
            _loss(model, x).backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    assert _equal(*results)
    assert rec is not None and rec.counts["replay"] >= 2


# --------------------------------------------------------------------------- CUDA only
@pytest.mark.cuda
def test_a_snapshot_restore_leaves_cudnn_rnn_dropout_as_eager_left_it(cuda_device: str) -> None:
    """``torch.cuda.set_rng_state`` re-seeds cuDNN's dropout state; the snapshot's restore must not."""
    runs = []
    for snap in (False, True):
        torch.manual_seed(0)
        model = Tagger("lstm", num_layers=2, dropout=0.5).to(cuda_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in _batches(4, device=cuda_device):
            if snap:
                StateSnapshot(model).restore()
            opt.zero_grad(set_to_none=True)
            _loss(model, x).backward()
            opt.step()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    assert _equal(*runs)


@pytest.mark.cuda
@pytest.mark.parametrize("wrap", ["step", "capture"])
def test_a_cuda_rnn_with_dropout_replays_exactly(cuda_device: str, wrap: str) -> None:
    """The recording call's extra runs (and capture's verifying rerun at the backward) advance
    cuDNN's dropout state; the call state puts it back. With the call state off, the extra runs'
    draws stay spent and later masks differ."""

    def make() -> nn.Module:
        return Tagger("gru", num_layers=2, dropout=0.3)

    batches = _batches(5, device=cuda_device)
    eager, _ = _train(make, batches, "eager", cuda_device)
    replayed, runner = _train(make, batches, wrap, cuda_device)
    assert _equal(eager, replayed)
    assert runner.counts["replay"] >= 3, runner.journal.format()
    unsafe, _ = _train(make, batches, wrap, cuda_device, unsafe_disable=["call_state"])
    assert not _equal(eager, unsafe)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_cuda_rnn_without_dropout_replays_exactly(cuda_device: str, kind: str) -> None:
    def make() -> nn.Module:
        return Tagger(kind, num_layers=2, bidirectional=True)

    batches = _batches(6, device=cuda_device)
    eager, _ = _train(make, batches, "eager", cuda_device)
    for wrap in ("step", "capture"):
        replayed, runner = _train(make, batches, wrap, cuda_device)
        assert _equal(eager, replayed), wrap
        assert runner.counts["replay"] >= 3, runner.journal.format()


class _HostOrdered(nn.Module):
    """Rows reordered by an order the forward computes on the host from the lengths and moves to
    the GPU: only that copy reads the lengths, so only it can key the recording."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        order = lengths.argsort(descending=True, stable=True).to(x.device)
        return self.lin(x[order]) * torch.arange(1, 5, device=x.device).view(4, 1, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("packing", ["sorted", "unsorted"])
@pytest.mark.parametrize("wrap", ["step", "capture"])
def test_cuda_packed_sequences_replay_keyed_by_their_lengths(
    cuda_device: str, wrap: str, packing: str
) -> None:
    """The lengths stay on the host beside a GPU net; an unsorted batch's sort indices move to the
    GPU inside the capture, from pinned memory the recording keeps (a capture refuses pageable)."""
    batches = _batches(6, packing, cuda_device)
    eager, _ = _train(lambda: Tagger("gru", packing), batches, "eager", cuda_device)
    replayed, runner = _train(lambda: Tagger("gru", packing), batches, wrap, cuda_device)
    assert _equal(eager, replayed)
    assert runner.counts["replay"] >= 2, runner.journal.format()
    assert not runner.retired


@pytest.mark.cuda
@pytest.mark.parametrize("wrap", ["step", "capture"])
def test_cuda_a_host_order_moved_to_the_gpu_keys_the_recording(cuda_device: str, wrap: str) -> None:
    """Each length pattern's order gets its recording; without the input-read key the first
    order is replayed for every batch."""
    batches = _batches(6, "unsorted", cuda_device)
    eager, _ = _train(_HostOrdered, batches, "eager", cuda_device)
    replayed, runner = _train(_HostOrdered, batches, wrap, cuda_device)
    assert _equal(eager, replayed)
    assert runner.counts["replay"] >= 2, runner.journal.format()
    off = negative_control("input_reads")
    unsafe, _ = _train(_HostOrdered, batches, wrap, cuda_device, unsafe_disable=off)
    assert not _equal(eager, unsafe)


class _MeanOverLengths(nn.Module):
    """Averages over each sequence's own steps with the lengths ``pad_packed_sequence`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(F, H, batch_first=True), nn.Linear(H, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        padded, lens = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=T)
        return self.head(padded.sum(1) / lens.to(x.device)[:, None].float())


@pytest.mark.parametrize("wrap", ["step", "capture"])
def test_the_lengths_pad_packed_sequence_returns_replay(backend: str, wrap: str) -> None:
    """Its C++ writes them into an empty tensor past the dispatcher: the tape makes them with
    aten calls instead (else it refuses to record a read of unfilled memory)."""
    device = "cuda" if backend == "cuda" else "cpu"
    batches = _batches(6, "unsorted", device)
    eager, _ = _train(_MeanOverLengths, batches, "eager", device)
    replayed, runner = _train(_MeanOverLengths, batches, wrap, device)
    assert _equal(eager, replayed)
    if backend != "cuda":  # on CUDA the lengths' copy to the GPU is of host memory made in the call
        assert runner.counts["replay"] >= 2, runner.journal.format()
