"""Whole-step benchmark: eager, ``make_graphed_callables``, network replay, whole-step replay
(:class:`~replaykit.step.TrainStep`) and a raw ``torch.cuda.graph`` of the whole step (the floor).

Same protocol as :mod:`replaykit.testing.bench.network`: one process, one model per arm from the
same weights, the same batches, interleaved rounds. A step is forward, the loss over the
four heads, backward, a fused SGD step (momentum 0.9) and ``zero_grad``. The raw graph
is the reference recipe of PyTorch's CUDA graphs notes (its warm-up steps train on the
first batch, so its weights are not compared); every other arm's end weights are
compared with eager's bit for bit. Not a test: timings are never asserted.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from replaykit.capturing import capture
from replaykit.workflow import tables

from ...step import TrainStep
from ...verify.bitwise import diff_states
from ..nets import DetectionNet
from .timing import (
    MEMORY_COLUMNS,
    SIZES,
    TIME_COLUMNS,
    ArmResult,
    Size,
    heads_loss,
    measure_peaks,
    memory_columns,
    peak_reset,
    sync,
)

ARMS = (
    "eager",
    "make_graphed_callables",
    "replaykit network",
    "replaykit step",
    "replaykit step check_every=100",
    "raw step graph",
)
#: the shadow check's cost is its arm against plain "replaykit step"
CHECKED = "replaykit step check_every=100"


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    fused = next(model.parameters()).is_cuda
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)


def _loop_step(
    call: Callable[[torch.Tensor], Any], opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor], None]:
    def step(x: torch.Tensor) -> None:
        heads_loss(call(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def raw_graph(
    model: nn.Module, opt: torch.optim.Optimizer, sample: torch.Tensor
) -> Callable[[torch.Tensor], None]:
    """PyTorch's whole-step capture recipe (forward, backward, step in one graph): the floor."""
    static_x = sample.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            heads_loss(model(static_x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        heads_loss(model(static_x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(x: torch.Tensor) -> None:
        static_x.copy_(x)
        graph.replay()

    return step


def _arm(
    name: str, model: nn.Module, sample: torch.Tensor, backend: str
) -> tuple[Callable[[torch.Tensor], None], Any]:
    opt = _sgd(model)
    if name == "eager":
        return _loop_step(model, opt), None
    if name == "make_graphed_callables":
        return _loop_step(torch.cuda.make_graphed_callables(model, (sample.clone(),)), opt), None
    if name == "replaykit network":
        rec = capture(model, backend=backend, warmup=3)
        return _loop_step(model, opt), rec
    if name in ("replaykit step", CHECKED):
        step = TrainStep(
            model,
            lambda m, x: heads_loss(m(x)),
            opt,
            backend=backend,
            check_every=100 if name == CHECKED else 0,
        )
        return step, step
    if name == "raw step graph":
        return raw_graph(model, opt, sample), None
    raise ValueError(name)


def bench_size(
    size: Size,
    device: torch.device,
    steps: int = 50,
    rounds: int = 5,
    warmup_steps: int = 5,
    backend: str = "auto",
) -> Iterator[ArmResult]:
    """Every arm at ``size`` (the graph-only arms on CUDA only)."""
    torch.manual_seed(0)
    base = DetectionNet(width=size.width, depth=size.depth).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [
        torch.randn(size.batch, 3, size.image, size.image, generator=g).to(device)
        for _ in range(steps)
    ]
    names = [
        a
        for a in ARMS
        if device.type == "cuda" or a in ("eager", "replaykit network", "replaykit step", CHECKED)
    ]
    arms: dict[str, tuple[Callable, Any, nn.Module]] = {}
    peaks: dict[str, tuple[float, float]] = {}
    for name in names:
        mem0 = peak_reset(device)
        model = copy.deepcopy(base)
        call, handle = _arm(name, model, batches[0], backend)
        for x in batches[:warmup_steps]:
            call(x)
        peaks[name] = measure_peaks(device, mem0)
        arms[name] = (call, handle, model)
    times: dict[str, list[float]] = {n: [] for n in names}
    timed = batches[warmup_steps:]
    per_round = max(1, len(timed) // rounds)
    for r in range(rounds):
        chunk = timed[r * per_round : (r + 1) * per_round] or timed[:per_round]
        for name, (call, _, _) in arms.items():
            sync(device)
            t0 = time.perf_counter()
            for x in chunk:
                call(x)
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3 / len(chunk))
    states = {
        n: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
        for n, (_, _, m) in arms.items()
    }
    for name, (_, handle, _) in arms.items():
        note = ""
        if handle is not None:
            note = f"replays={handle.counts['replay']} eager={dict(handle.eager_reasons)}"
            handle.release()
        t = times[name]
        qs = statistics.quantiles(t, n=10) if len(t) > 1 else t * 9
        equal = name != "raw step graph" and not diff_states(states["eager"], states[name])
        if name == CHECKED:
            note += f" checks={handle.counts['check']}"
        allocated, reserved = peaks[name]
        yield ArmResult(
            size.name,
            name,
            statistics.median(t),
            qs[0],
            qs[-1],
            allocated,
            equal,
            note,
            t,
            reserved,
        )


def run(
    sizes: tuple[Size, ...] = SIZES,
    device: str | torch.device | None = None,
    steps: int = 50,
    rounds: int = 5,
    backend: str = "auto",
    progress: Callable[[ArmResult], None] | None = None,
) -> list[ArmResult]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = []
    for size in sizes:
        for result in bench_size(size, dev, steps=steps, rounds=rounds, backend=backend):
            out.append(result)
            if progress:
                progress(result)
    return out


def table(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Rows with ratios against eager, network replay and the raw whole-step graph."""
    by = {(r.size, r.arm): r for r in results}
    rows = []
    for r in results:
        row = {k: v for k, v in r.__dict__.items() if k != "step_ms"}
        row["speedup_vs_eager"] = by[(r.size, "eager")].median_ms / r.median_ms
        row.update(memory_columns(r, by[(r.size, "eager")]))
        raw = by.get((r.size, "raw step graph"))
        if raw is not None:
            row["time_vs_raw_graph"] = r.median_ms / raw.median_ms
        if r.arm == CHECKED:
            plain = by[(r.size, "replaykit step")]
            row["time_vs_unchecked"] = r.median_ms / plain.median_ms
            # the rounds holding a check are few: the median leaves them out, the mean pays for them
            row["time_vs_unchecked_amortized"] = statistics.fmean(r.step_ms) / statistics.fmean(
                plain.step_ms
            )
        net = by.get((r.size, "replaykit network"))
        if net is not None and net.peak_mib == net.peak_mib and net.peak_mib > 0:  # nan on a CPU
            row["mem_vs_network"] = r.peak_mib / net.peak_mib
        rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [r for r in rows if r["arm"] == "replaykit step"]
    parts = []
    for r in mine:
        raw = f", {r['time_vs_raw_graph']:.3f}x raw graph time" if "time_vs_raw_graph" in r else ""
        mem = f", {r['mem_vs_network']:.3f}x network-replay memory" if "mem_vs_network" in r else ""
        reserved = r["reserved_vs_eager"]
        if reserved == reserved:  # measured (CUDA)
            mem += f", {reserved:.3f}x eager's peak reserved"
        parts.append(f"{r['size']}: {r['speedup_vs_eager']:.2f}x eager{raw}{mem}")
    checks = "; ".join(
        f"{r['size']} {r['time_vs_unchecked_amortized']:.3f}x (median {r['time_vs_unchecked']:.3f}x)"
        for r in rows
        if r["arm"] == CHECKED
    )
    equal = all(
        r["equals_eager"]
        for r in rows
        if r["arm"] in ("replaykit step", "replaykit network", CHECKED)
    )
    line = (
        "whole step "
        + "; ".join(parts)
        + f"; check_every=100 vs unchecked, amortized over every step: {checks}; bitwise equal to eager: {equal}"
    )
    return {"line": line, "step_equal": equal, "rows": rows}


COLUMNS = (
    "size",
    "arm",
    *TIME_COLUMNS,
    "time_vs_raw_graph",
    "time_vs_unchecked",
    "time_vs_unchecked_amortized",
    *MEMORY_COLUMNS,
    "mem_vs_network",
    "equals_eager",
    "note",
)


def markdown(rows: list[dict[str, Any]]) -> str:
    return tables.markdown(rows, COLUMNS)
