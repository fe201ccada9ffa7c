"""Variable-length batches padded to a few bucket lengths (a Hugging Face style loop): eager
against whole-step replay, time and memory.

Each batch has its own length, padded to the next bucket (pad token 0, label -100, which the
loss ignores), so a run sees one input shape per bucket. A ``TrainStep`` records each bucket once
and replays it after; its recordings share one memory pool, so the buckets' scratch memory is
shared too. Arms: ``eager``; ``TrainStep`` (one step, one pool for all buckets);
``TrainStep per bucket`` (a step per bucket, each with a pool of its own: the memory a
per-shape setup costs) and ``TrainStep per bucket, shared pool`` (the same with ``pool=`` one
``rk.MemoryPool``). Every arm trains the same model copy on the same batches and must end
bitwise equal to eager. The whole run is timed, recordings included: the speedup a user sees.
Not a test: timings are never asserted.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replaykit.workflow import tables

from ...memory.pool import MemoryPool
from ...step import TrainStep
from ...verify.bitwise import diff_states
from ..zoo.language import TinyLM
from .timing import MEMORY_COLUMNS, ArmResult, measure_peaks, memory_columns, peak_reset, sync

VOCAB = 256
ARMS = ("eager", "TrainStep", "TrainStep per bucket", "TrainStep per bucket, shared pool")
#: not a default arm: what the recording call's verification (an eager step beside the pool) costs
UNVERIFIED = "TrainStep, verify_recording off"


def bucket_lengths(n: int, longest: int) -> tuple[int, ...]:
    """``n`` bucket lengths evenly up to ``longest``."""
    return tuple(longest * (i + 1) // n for i in range(n))


def padded_batches(
    steps: int, batch: int, buckets: tuple[int, ...], device: torch.device, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (tokens, labels) pairs of random lengths, each padded to its bucket."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = int(torch.randint(2, buckets[-1] + 1, (1,), generator=g))
        length = next(b for b in buckets if b >= n)
        tokens = torch.zeros(batch, length, dtype=torch.long)
        labels = torch.full((batch, length), -100, dtype=torch.long)
        seq = torch.randint(1, VOCAB, (batch, n + 1), generator=g)
        tokens[:, :n] = seq[:, :-1]
        labels[:, :n] = seq[:, 1:]
        out.append((tokens.to(device), labels.to(device)))
    return out


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; padding (label -100) is ignored."""
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    fused = next(model.parameters()).is_cuda
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)


def _arm(
    name: str, model: nn.Module, buckets: tuple[int, ...], backend: str
) -> tuple[Callable[..., Any], list[TrainStep]]:
    opt = _optimizer(model)
    if name == "eager":
        twin = TrainStep(model, lm_loss, opt, replay=False)
        return twin, []
    if name in ("TrainStep", UNVERIFIED):
        off = ("verify_recording",) if name == UNVERIFIED else ()
        step = TrainStep(
            model, lm_loss, opt, backend=backend, max_recordings=len(buckets), unsafe_disable=off
        )
        return step, [step]
    pool = MemoryPool() if name.endswith("shared pool") else None
    steps = {
        b: TrainStep(model, lm_loss, opt, backend=backend, max_recordings=1, pool=pool)
        for b in buckets
    }

    def call(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return steps[tokens.shape[1]](tokens, labels)

    return call, list(steps.values())


def bench(
    n_buckets: int = 4,
    device: str | torch.device | None = None,
    steps: int = 60,
    batch: int = 8,
    longest: int = 128,
    dim: int = 256,
    layers: int = 4,
    backend: str = "auto",
    arms: tuple[str, ...] = ARMS,
) -> list[ArmResult]:
    """Every arm over the same ``steps`` padded batches; ``median_ms`` is the steady step time (the
    last half), the note has the whole run's time, recordings included, and the journal counts."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    buckets = bucket_lengths(n_buckets, longest)
    torch.manual_seed(0)
    base = TinyLM(vocab=VOCAB, context=longest, dim=dim, layers=layers, heads=max(1, dim // 64))
    base.to(dev)
    data = padded_batches(steps, batch, buckets, dev)
    # first-use costs of the process (cuBLAS handles, each shape's kernels) go to no arm: the first
    # arm paid them (eager, which took twice its warmed time over this run on the H200)
    warm, _ = _arm("eager", copy.deepcopy(base), buckets, backend)
    for tokens, labels in {t.shape[1]: (t, y) for t, y in data}.values():
        warm(tokens, labels)
    sync(dev)
    results, states = [], {}
    for name in arms:
        mem = peak_reset(dev)
        model = copy.deepcopy(base)
        call, entry_points = _arm(name, model, buckets, backend)
        torch.manual_seed(2)  # dropout: every arm draws eager's masks
        times = []
        sync(dev)
        start = time.perf_counter()
        for tokens, labels in data:
            t0 = time.perf_counter()
            call(tokens, labels)
            sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        total = (time.perf_counter() - start) * 1e3
        allocated, reserved = measure_peaks(dev, mem)
        states[name] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        records = sum(s.counts["record"] for s in entry_points)
        replays = sum(s.counts["replay"] for s in entry_points)
        eager = sum(s.counts["eager"] for s in entry_points)
        note = f"total_ms={total:.1f} records={records} replays={replays} eager={eager}"
        for s in entry_points:
            s.release()
        steady = times[len(times) // 2 :]
        qs = statistics.quantiles(steady, n=10) if len(steady) > 1 else steady * 9
        results.append(
            ArmResult(
                f"{n_buckets} buckets",
                name,
                statistics.median(steady),
                qs[0],
                qs[-1],
                allocated,
                None,
                note,
                times,
                reserved,
            )
        )
    for r in results:
        r.equals_eager = not diff_states(states["eager"], states[r.arm])
    return results


def total_ms(result: ArmResult) -> float:
    """The whole run's time (recordings included), from the note."""
    return float(result.note.split()[0].split("=")[1])


def break_even(result: ArmResult, eager: ArmResult) -> int | None:
    """The number of batches from which on the arm's run so far is never slower than eager's
    (its recordings paid back), or None when it is slower at the end."""
    mine = eagers = 0.0
    since: int | None = None
    for n, (t, e) in enumerate(zip(result.step_ms, eager.step_ms, strict=True), start=1):
        mine, eagers = mine + t, eagers + e
        if mine > eagers:
            since = None
        elif since is None:
            since = n
    return since


def table(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Rows with the whole run's time and memory beside eager's, and where its recordings paid back."""
    eager = {r.size: r for r in results if r.arm == "eager"}
    rows = []
    for r in results:
        row = {k: v for k, v in vars(r).items() if k != "step_ms"}
        e = eager[r.size]
        row["total_ms"] = total_ms(r)
        row["run_speedup_vs_eager"] = total_ms(e) / total_ms(r)
        row["break_even_batch"] = break_even(r, e)
        row["step_speedup_vs_eager"] = e.median_ms / r.median_ms
        row.update(memory_columns(r, e))
        rows.append(row)
    return rows


COLUMNS = (
    "size",
    "arm",
    "total_ms",
    "run_speedup_vs_eager",
    "break_even_batch",
    "median_ms",
    "step_speedup_vs_eager",
    *MEMORY_COLUMNS,
    "equals_eager",
    "note",
)


def markdown(rows: list[dict[str, Any]]) -> str:
    return tables.markdown(rows, COLUMNS)
