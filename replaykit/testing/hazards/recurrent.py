"""Recurrent nets (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): the state torch keeps beside them.

``nn.RNNBase`` caches its weights (``_flat_weights``) and refreshes the cache, on CUDA
re-flattening the weights into a new cuDNN buffer, whenever it finds a parameter changed: a
run on the recorder's stand-ins used to read as a side effect (every ``rk.capture`` of a
recurrent net retired). ``pack_padded_sequence`` reads its lengths on the host inside the
packing kernel, where no ``.item()`` shows: a recording not keyed by them replays the first
batch's lengths (a crash on the emulated backend, a silent difference on CUDA); an unsorted
batch's sort indices go to the GPU and back, copies keyed the same way. cuDNN's RNN
dropout draws from a private state that a recording call's extra runs would advance: on
CUDA such a net runs eagerly (``replaykit/guards/recurrent.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .pattern import Arm, Extras, Pattern, sgd
from .writing import HazardClass

HAZARD = "recurrent"
HC = HazardClass(HAZARD)

T, F, H = 5, 6, 8
#: Lengths per batch (a packed batch's are read on the host): two patterns, each seen again.
LENGTHS = ([5, 3, 4, 1], [2, 5, 5, 3], [5, 1, 2, 2])


class Tagger(nn.Module):
    """A recurrent encoder and a per-step head (a tagger, a language model's shape)."""

    def __init__(self, kind: type[nn.RNNBase] = nn.LSTM, **kw: object) -> None:
        super().__init__()
        self.rnn = kind(F, H, batch_first=True, **kw)
        self.head = nn.Linear(H * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class PackedTagger(Tagger):
    """The same over a padded batch packed by its lengths (``enforce_sorted`` or not)."""

    def __init__(self, sorted_: bool, kind: type[nn.RNNBase] = nn.GRU) -> None:
        super().__init__(kind)
        self.sorted = sorted_

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.sorted)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=T)
        return self.head(out)


def _lengths(step: int, sorted_: bool) -> torch.Tensor:
    """A CPU tensor, as ``pack_padded_sequence`` wants; steps cycle through :data:`LENGTHS`."""
    lengths = torch.tensor(LENGTHS[step % len(LENGTHS)])
    return lengths.sort(descending=True).values if sorted_ else lengths


def _mse(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    return model(*batch).pow(2).mean()


def _loop(model: nn.Module, arm: Arm, steps: int = 5, packed: bool = False) -> Extras:
    """The plain loop a captured net trains in; ``packed``: batches with their lengths."""
    opt = sgd(model)
    kept: Extras = {}
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        batch = [arm.randn(4, T, F)]
        if packed:
            batch.append(_lengths(i, model.sorted))
        loss = _mse(model, *batch)
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()
    return kept


def _validated(model: nn.Module, arm: Arm) -> Extras:
    """The plain loop with a validation forward in eval mode after every step."""
    opt = sgd(model)
    kept: Extras = {}
    held_out = arm.randn(4, T, F)
    for i in range(4):
        opt.zero_grad(set_to_none=True)
        loss = _mse(model, arm.randn(4, T, F))
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            kept[f"val{i}"] = _mse(model, held_out)
        model.train()
        kept[f"loss{i}"] = loss.detach()
    return kept


def _stepped(steps: int = 6, packed: bool = False, **step_kwargs: object):
    """A step pattern's loop through ``rk.TrainStep`` (``packed``: batches with their lengths)."""

    def train(model: nn.Module, arm: Arm) -> Extras:
        step = arm.train_step(model, _mse, sgd(model), **step_kwargs)
        kept: Extras = {}
        for i in range(steps):
            batch = [arm.randn(4, T, F)]
            if packed:
                batch.append(_lengths(i, model.sorted))
            kept[f"loss{i}"] = step(*batch).detach()
        return kept

    return train


_CPU_LENGTHS = (
    "run on the CPU only: on CUDA the arm retired (its capture failed on the CPU lengths) until "
    "2026-12-03, and has not run there since the guarded arm replays"
)

PATTERNS: list[Pattern] = [
    HC.pattern(
        "lstm_two_layers_captured",
        "a 2-layer LSTM tagger with dropout between its layers under rk.capture",
        lambda d: Tagger(nn.LSTM, num_layers=2, dropout=0.2).to(d),
        _loop,
    ),
    HC.pattern(
        "gru_bidirectional_captured",
        "a bidirectional GRU tagger under rk.capture",
        lambda d: Tagger(nn.GRU, bidirectional=True).to(d),
        _loop,
    ),
    HC.pattern(
        "lstm_validated_in_eval",
        "a captured LSTM validated in eval mode under no_grad after every step",
        lambda d: Tagger(nn.LSTM, num_layers=2, dropout=0.2).to(d),
        _validated,
    ),
    HC.pattern(
        "packed_gru_captured",
        "a captured GRU over pack_padded_sequence(enforce_sorted=False), lengths per batch",
        lambda d: PackedTagger(False).to(d),
        lambda m, a: _loop(m, a, steps=6, packed=True),
        guard="input_reads",
        cpu_only=_CPU_LENGTHS,
    ),
    HC.pattern(
        "step_packed_lstm_sorted",
        "an LSTM over sorted packed sequences, lengths per batch, whole step",
        lambda d: PackedTagger(True, nn.LSTM).to(d),
        _stepped(packed=True),
        guard="input_reads",
        api="step",
    ),
    HC.pattern(
        "step_packed_gru_unsorted",
        "a GRU over unsorted packed sequences (enforce_sorted=False), whole step",
        lambda d: PackedTagger(False).to(d),
        _stepped(packed=True),
        guard="input_reads",
        cpu_only="run on the CPU only: on CUDA the arm retired (the capture refused the sort "
        "indices' copy) until 2026-12-03, and has not run there since the guarded arm replays",
        api="step",
    ),
    HC.pattern(
        "step_lstm_dropout_accumulated",
        "a 2-layer LSTM with dropout 0.3, two micro-batches per step, whole step",
        lambda d: Tagger(nn.LSTM, num_layers=2, dropout=0.3).to(d),
        _stepped(steps=8, accumulate=2),
        api="step",
    ),
    HC.pattern(
        "step_gru_bidirectional_bf16",
        "a bidirectional GRU tagger, whole step under bf16-mixed",
        lambda d: Tagger(nn.GRU, bidirectional=True).to(d),
        _stepped(precision="bf16-mixed"),
        api="step",
    ),
    HC.pattern(
        "step_lstm_projected",
        "an LSTM with proj_size (its head reads the projection), whole step",
        lambda d: _projected().to(d),
        _stepped(),
        api="step",
    ),
]


def _projected() -> Tagger:
    model = Tagger(nn.LSTM, proj_size=4)
    model.head = nn.Linear(4, 3)
    return model


KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``. None now."""
