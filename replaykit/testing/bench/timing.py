"""What every benchmark here shares: the workload sizes, an arm that trains one model, the
interleaved timing of several arms, peak memory, and each arm's end state against eager's.

One process, one model per arm from the same initial weights, the same batches, and rounds
that interleave the arms so clock and thermal drift hit all of them alike. Not a test:
timings are never asserted.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ...backends import workspaces
from ...verify.bitwise import diff_states


@dataclass(frozen=True)
class Size:
    """A workload: batch, image side, network width and depth."""

    name: str
    batch: int
    image: int
    width: int
    depth: int


SIZES: tuple[Size, ...] = (
    Size("launch-bound", 8, 32, 16, 3),
    Size("medium", 32, 64, 48, 4),
    Size("gpu-bound", 64, 128, 96, 5),
)


@dataclass
class ArmResult:
    """One arm at one size."""

    size: str
    arm: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    peak_mib: float
    equals_eager: bool | None
    note: str = ""
    step_ms: list[float] = field(default_factory=list, repr=False)
    peak_reserved_mib: float = (
        math.nan
    )  # what the caching allocator held at the peak (pools included)


def heads_loss(out: Any) -> torch.Tensor:
    """The benchmarks' loss: every head's output squared and averaged, summed (a dict or a tuple of heads)."""
    values = out.values() if isinstance(out, dict) else out
    return sum(o.float().square().mean() for o in values)  # type: ignore[return-value]


class TimedArm:
    """A model, its optimizer and how to call it.

    A batch is one input tensor (the loss: ``heads_loss`` over the heads), or, with ``loss``, an
    ``(args, targets)`` pair called under ``context()`` (autocast), with ``scaler`` for fp16;
    ``args`` is a tuple, or a dict of keyword arguments (a transformers model's batch).
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        call: Callable[..., Any],
        release=None,
        loss: Callable[[Any, Any], torch.Tensor] | None = None,
        context: Callable[[], Any] = contextlib.nullcontext,
        scaler: Any = None,
    ) -> None:
        self.name = name
        self.model = model
        self.call = call
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.release = release  # the recorder, for replaykit
        self.loss, self.context, self.scaler = loss, context, scaler
        self.rng: tuple | None = None  # its own RNG stream (dropout): see keep_rng
        self.times: list[float] = []

    def keep_rng(self, device: torch.device) -> None:
        """From now on this arm draws from its own copy of the current RNG state (interleaved arms
        would otherwise take turns on one stream, and no two would draw the same dropout masks)."""
        self.rng = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        )

    def swap_rng(self, device: torch.device) -> None:
        """Put this arm's RNG stream in and the shared one away (or back): called around its timed span."""
        if self.rng is None:
            return
        mine = self.rng
        self.rng = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        )
        torch.set_rng_state(mine[0])
        if mine[1] is not None:
            torch.cuda.set_rng_state(mine[1], device)

    def step(self, batch: Any) -> None:
        if self.loss is None:
            value = heads_loss(self.call(batch))
        else:
            args, targets = batch
            with self.context():
                value = self.loss(
                    self.call(**args) if isinstance(args, dict) else self.call(*args), targets
                )
        if self.scaler is not None:
            self.scaler.scale(value).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            value.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    """Wait for the device (a timer around queued CUDA work measures nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryBase(NamedTuple):
    """The bytes allocated and reserved when a peak-memory window opened."""

    allocated: float
    reserved: float


def peak_reset(device: torch.device) -> MemoryBase:
    """Start a peak-memory window (cached blocks and cuBLAS's workspaces given back first, so the
    arm pays for its own: a workspace an earlier arm made would be free to the next one);
    returns the baseline for :func:`peak_mib` and :func:`peak_reserved_mib`."""
    if device.type != "cuda":
        return MemoryBase(0.0, 0.0)
    gc.collect()
    torch.cuda.synchronize(device)
    workspaces.clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return MemoryBase(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


def peak_mib(device: torch.device, base: MemoryBase) -> float:
    """MiB allocated at the peak since :func:`peak_reset` above its baseline (NaN off CUDA)."""
    if device.type != "cuda":
        return math.nan
    return (torch.cuda.max_memory_allocated(device) - base.allocated) / 2**20


def peak_reserved_mib(device: torch.device, base: MemoryBase) -> float:
    """MiB the caching allocator reserved at the peak since :func:`peak_reset` above its baseline:
    what the arm took from the GPU, graph pools and other streams' cached blocks included (NaN off CUDA)."""
    if device.type != "cuda":
        return math.nan
    return (torch.cuda.max_memory_reserved(device) - base.reserved) / 2**20


def measure_peaks(device: torch.device, base: MemoryBase) -> tuple[float, float]:
    """Both peaks of the window (allocated, reserved), after the device's queued work."""
    sync(device)
    return peak_mib(device, base), peak_reserved_mib(device, base)


#: the timing columns the bench tables lead with: an arm's percentiles and its ratio to eager
TIME_COLUMNS = ("median_ms", "p10_ms", "p90_ms", "speedup_vs_eager")
#: the allocated peak and :func:`memory_columns`' keys: an arm's memory beside eager's
MEMORY_COLUMNS = ("peak_mib", "peak_reserved_mib", "alloc_vs_eager", "reserved_vs_eager")


def memory_columns(result: Any, eager: Any) -> dict[str, float]:
    """An arm's memory beside eager's at the same size (both ArmResults): the peak reserved, and the
    allocated and reserved peaks as ratios of eager's. NaN off CUDA (tables print ``n/a``): no
    number is made up where nothing was measured."""

    def ratio(mine: float, theirs: float) -> float:
        return mine / theirs if theirs > 0 else math.nan  # NaN stays NaN

    return {
        "peak_reserved_mib": result.peak_reserved_mib,
        "alloc_vs_eager": ratio(result.peak_mib, eager.peak_mib),
        "reserved_vs_eager": ratio(result.peak_reserved_mib, eager.peak_reserved_mib),
    }


def interleave(arms: list[TimedArm], timed: list[Any], rounds: int, device: torch.device) -> None:
    """Time the arms in ``rounds`` interleaved chunks of ``timed`` (drift hits every arm alike)."""
    per_round = max(1, len(timed) // rounds)
    for r in range(rounds):
        chunk = timed[r * per_round : (r + 1) * per_round] or timed[:per_round]
        for arm in arms:
            arm.swap_rng(device)  # its own stream in, the shared one out (outside the timed span)
            sync(device)
            t0 = time.perf_counter()
            for x in chunk:
                arm.step(x)
            sync(device)
            arm.times.append((time.perf_counter() - t0) * 1e3 / len(chunk))
            arm.swap_rng(device)


def timed_results(
    size: str,
    arms: list[TimedArm],
    timed: list[Any],
    rounds: int,
    device: torch.device,
    peaks: dict[str, float] | dict[str, tuple[float, float]],
    notes: dict[str, str] | None = None,
) -> Iterator[ArmResult]:
    """Interleave the arms over ``timed``, then one result per arm; each arm's end state against eager's."""
    interleave(arms, timed, rounds, device)
    states = {
        a.name: {k: v.detach().cpu().clone() for k, v in a.model.state_dict().items()} for a in arms
    }
    for arm in arms:
        note = (notes or {}).get(arm.name, "")
        if arm.release is not None:
            rec = arm.release
            note = f"replays={rec.counts['replay']} eager={dict(rec.eager_reasons)}"
            if rec.retired:
                note += f" retired: {rec.retire_reason}"
            rec.release()
        t = arm.times
        qs = statistics.quantiles(t, n=10) if len(t) > 1 else t * 9
        peak = peaks[arm.name]
        allocated, reserved = peak if isinstance(peak, tuple) else (peak, math.nan)
        yield ArmResult(
            size,
            arm.name,
            statistics.median(t),
            qs[0],
            qs[-1],
            allocated,
            not diff_states(states["eager"], states[arm.name]),
            note,
            t,
            reserved,
        )
