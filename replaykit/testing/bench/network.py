"""Replay benchmark: eager vs ``torch.cuda.make_graphed_callables`` vs replaykit, side by side.

The arms and their interleaved timing are :mod:`.timing`'s. A step is forward, a loss over
the four head outputs, backward, SGD step and ``zero_grad``. Reported: median step time
per arm, ratios, peak memory, and whether each arm's end weights equal eager's bit for
bit (a benchmark that trains wrong measures nothing). Not a test: timings are never
asserted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from replaykit.capturing import capture
from replaykit.workflow import tables

from ..nets import DetectionNet
from .timing import (
    MEMORY_COLUMNS,
    SIZES,
    TIME_COLUMNS,
    ArmResult,
    Size,
    TimedArm,
    measure_peaks,
    memory_columns,
    peak_reset,
    timed_results,
)

#: The arm that pays for the shadow check (every ``check_every``-th replayed call against eager).
CHECKED = "replaykit+check"


def _make_arm(
    name: str, model: nn.Module, sample: torch.Tensor, backend: str, check_every: int = 0
) -> TimedArm:
    if name == "eager":
        return TimedArm(name, model, model)
    if name == "make_graphed_callables":
        # make_graphed_callables adopts its sample as the static input and overwrites it
        graphed = torch.cuda.make_graphed_callables(model, (sample.clone(),))
        return TimedArm(name, model, graphed)
    rec = capture(
        model, backend=backend, warmup=3, check_every=check_every if name == CHECKED else 0
    )
    return TimedArm(name, model, model, release=rec)


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
        torch.randn(size.batch, 3, size.image, size.image, generator=g).to(device)
        for _ in range(steps)
    ]
    names = ["eager", "replaykit"] + ([CHECKED] if check_every else [])
    if device.type == "cuda":
        names.insert(1, "make_graphed_callables")
    arms: list[TimedArm] = []
    peaks: dict[str, tuple[float, float]] = {}
    for name in names:  # peak memory per arm: its build (capture, pools) and warm-up steps
        mem0 = peak_reset(device)
        arm = _make_arm(name, copy.deepcopy(base), batches[0], backend, check_every)
        for x in batches[:warmup_steps]:
            arm.step(x)
        peaks[name] = measure_peaks(device, mem0)
        arms.append(arm)
    yield from timed_results(size.name, arms, batches[warmup_steps:], rounds, device, peaks)


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
        for result in bench_size(
            size, dev, steps=steps, rounds=rounds, backend=backend, check_every=check_every
        ):
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
        row.update(memory_columns(r, eager))
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
        vs = (
            f", {r['time_vs_mgc']:.3f}x mgc time, {r['mem_vs_mgc']:.3f}x mgc memory"
            if "time_vs_mgc" in r
            else ""
        )
        if r["reserved_vs_eager"] == r["reserved_vs_eager"]:  # measured (CUDA)
            vs += f", {r['reserved_vs_eager']:.3f}x eager's peak reserved"
        parts.append(f"{r['size']}: {r['speedup_vs_eager']:.2f}x eager{vs}")
    checked = {r["size"]: r for r in rows if r["arm"] == CHECKED}
    for r in mine:
        c = checked.get(r["size"])
        if c is not None:
            parts.append(
                f"{r['size']} shadow check: {c['median_ms'] / r['median_ms']:.3f}x replaykit time"
            )
    equal = all(r["equals_eager"] for r in rows if r["arm"] in ("replaykit", CHECKED))
    return {
        "line": "replaykit " + "; ".join(parts) + f"; bitwise equal to eager: {equal}",
        "replaykit_equal": equal,
        "rows": rows,
    }


MARKDOWN_COLUMNS = (
    "size",
    "arm",
    *TIME_COLUMNS,
    "time_vs_mgc",
    *MEMORY_COLUMNS,
    "mem_vs_mgc",
    "equals_eager",
)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown."""
    return tables.markdown(rows, MARKDOWN_COLUMNS)
