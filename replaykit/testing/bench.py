"""Replay benchmark: eager vs ``torch.cuda.make_graphed_callables`` vs replaykit, side by side.

One process, one model per arm from the same initial weights, the same batches, and
rounds that interleave the arms so clock and thermal drift hit all of them alike.
A step is forward, a loss over the four head outputs, backward, SGD step and
``zero_grad``. Reported: median step time per arm, ratios, peak memory, and whether
each arm's end weights equal eager's bit for bit (a benchmark that trains wrong
measures nothing). Not a test: timings are never asserted.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from replaykit import tables
from replaykit.recorder import capture

from ..bitwise import diff_states
from .nets import DetectionNet


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


def _loss(out: Any) -> torch.Tensor:
    values = out.values() if isinstance(out, dict) else out
    return sum(o.float().square().mean() for o in values)  # type: ignore[return-value]


class _Arm:
    """A model, its optimizer and how to call it.

    A batch is one input tensor (the loss: ``_loss`` over the heads), or, with ``loss``, an
    ``(args, targets)`` pair called under ``context()`` (autocast), with ``scaler`` for fp16.
    """

    def __init__(
        self, name: str, model: nn.Module, call: Callable[..., Any], release=None,
        loss: Callable[[Any, Any], torch.Tensor] | None = None,
        context: Callable[[], Any] = contextlib.nullcontext, scaler: Any = None,
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
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def _swap_rng(self, device: torch.device) -> None:
        if self.rng is None:
            return
        mine = self.rng
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        torch.set_rng_state(mine[0])
        if mine[1] is not None:
            torch.cuda.set_rng_state(mine[1], device)

    def step(self, batch: Any) -> None:
        if self.loss is None:
            value = _loss(self.call(batch))
        else:
            args, targets = batch
            with self.context():
                value = self.loss(self.call(*args), targets)
        if self.scaler is not None:
            self.scaler.scale(value).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            value.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device, base: float) -> float:
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")


#: The arm that pays for the shadow check (every ``check_every``-th replayed call against eager).
CHECKED = "replaykit+check"


def _make_arm(name: str, model: nn.Module, sample: torch.Tensor, backend: str, check_every: int = 0) -> _Arm:
    if name == "eager":
        return _Arm(name, model, model)
    if name == "make_graphed_callables":
        # make_graphed_callables adopts its sample as the static input and overwrites it
        graphed = torch.cuda.make_graphed_callables(model, (sample.clone(),))
        return _Arm(name, model, graphed)
    rec = capture(model, backend=backend, warmup=3, check_every=check_every if name == CHECKED else 0)
    return _Arm(name, model, model, release=rec)


def bench_size(
    size: Size,
    device: torch.device,
    steps: int = 50,
    rounds: int = 5,
    warmup_steps: int = 5,
    backend: str = "auto",
    check_every: int = 0,
) -> Iterator[ArmResult]:
    """Time every arm at ``size``; yields one result per arm (``check_every``: add the shadow-checked arm)."""
    torch.manual_seed(0)
    base = DetectionNet(width=size.width, depth=size.depth).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [
        torch.randn(size.batch, 3, size.image, size.image, generator=g).to(device) for _ in range(steps)
    ]
    names = ["eager", "replaykit"] + ([CHECKED] if check_every else [])
    if device.type == "cuda":
        names.insert(1, "make_graphed_callables")
    arms: list[_Arm] = []
    peaks: dict[str, float] = {}
    for name in names:  # peak memory per arm: its build (capture, pools) and warm-up steps
        mem0 = _peak_reset(device)
        arm = _make_arm(name, copy.deepcopy(base), batches[0], backend, check_every)
        for x in batches[:warmup_steps]:
            arm.step(x)
        _sync(device)
        peaks[name] = _peak(device, mem0)
        arms.append(arm)
    yield from timed_results(size.name, arms, batches[warmup_steps:], rounds, device, peaks)


def interleave(arms: list[_Arm], timed: list[Any], rounds: int, device: torch.device) -> None:
    """Time the arms in ``rounds`` interleaved chunks of ``timed`` (drift hits every arm alike)."""
    per_round = max(1, len(timed) // rounds)
    for r in range(rounds):
        chunk = timed[r * per_round : (r + 1) * per_round] or timed[:per_round]
        for arm in arms:
            arm._swap_rng(device)  # its own stream in, the shared one out (outside the timed span)
            _sync(device)
            t0 = time.perf_counter()
            for x in chunk:
                arm.step(x)
            _sync(device)
            arm.times.append((time.perf_counter() - t0) * 1e3 / len(chunk))
            arm._swap_rng(device)


def timed_results(
    size: str, arms: list[_Arm], timed: list[Any], rounds: int, device: torch.device,
    peaks: dict[str, float], notes: dict[str, str] | None = None,
) -> Iterator[ArmResult]:
    """Interleave the arms over ``timed``, then one result per arm; each arm's end state against eager's."""
    interleave(arms, timed, rounds, device)
    states = {a.name: {k: v.detach().cpu().clone() for k, v in a.model.state_dict().items()} for a in arms}
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
        yield ArmResult(
            size, arm.name, statistics.median(t), qs[0], qs[-1], peaks[arm.name],
            not diff_states(states["eager"], states[arm.name]), note, t,
        )


def run(
    sizes: tuple[Size, ...] = SIZES,
    device: str | torch.device | None = None,
    steps: int = 50,
    rounds: int = 5,
    backend: str = "auto",
    progress: Callable[[ArmResult], None] | None = None,
    check_every: int = 0,
) -> list[ArmResult]:
    """Benchmark every size; ``progress`` hears each result as it comes."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = []
    for size in sizes:
        for result in bench_size(size, dev, steps=steps, rounds=rounds, backend=backend, check_every=check_every):
            out.append(result)
            if progress:
                progress(result)
    return out


def table(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Rows with ratios against eager and against make_graphed_callables where it ran."""
    rows = []
    by = {(r.size, r.arm): r for r in results}
    for r in results:
        eager = by[(r.size, "eager")]
        mgc = by.get((r.size, "make_graphed_callables"))
        row = {k: v for k, v in asdict(r).items() if k != "step_ms"}
        row["speedup_vs_eager"] = eager.median_ms / r.median_ms
        if mgc is not None:
            row["time_vs_mgc"] = r.median_ms / mgc.median_ms
            row["mem_vs_mgc"] = r.peak_mib / mgc.peak_mib if mgc.peak_mib else float("nan")
        rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios per size for summary.json, and one line for a log."""
    mine = [r for r in rows if r["arm"] == "replaykit"]
    parts = []
    for r in mine:
        vs = f", {r['time_vs_mgc']:.3f}x mgc time, {r['mem_vs_mgc']:.3f}x mgc memory" if "time_vs_mgc" in r else ""
        parts.append(f"{r['size']}: {r['speedup_vs_eager']:.2f}x eager{vs}")
    checked = {r["size"]: r for r in rows if r["arm"] == CHECKED}
    for r in mine:
        c = checked.get(r["size"])
        if c is not None:
            parts.append(f"{r['size']} shadow check: {c['median_ms'] / r['median_ms']:.3f}x replaykit time")
    equal = all(r["equals_eager"] for r in rows if r["arm"] in ("replaykit", CHECKED))
    return {
        "line": "replaykit " + "; ".join(parts) + f"; bitwise equal to eager: {equal}",
        "replaykit_equal": equal,
        "rows": rows,
    }


MARKDOWN_COLUMNS = (
    "size", "arm", "median_ms", "p10_ms", "p90_ms", "speedup_vs_eager", "time_vs_mgc", "peak_mib", "mem_vs_mgc", "equals_eager",
)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown."""
    return tables.markdown(rows, MARKDOWN_COLUMNS)
