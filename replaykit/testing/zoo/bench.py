"""Zoo step times: eager vs ``torch.cuda.make_graphed_callables`` vs replaykit (``rk.capture``) vs
``rk.TrainStep``, per model × precision × batch.

The arms and their interleaved timing are :mod:`replaykit.testing.bench.timing`'s; a zoo step is
forward, the model's loss, backward (a GradScaler for ``16-mixed``), SGD step and
``zero_grad``, at each model's batches (``ZooModel.batches``); the ``replaykit step`` arm is
the same step as one ``rk.TrainStep``. Autocast runs with its cast cache on for eager and
replaykit, as users write it, and off for ``make_graphed_callables``, which requires that
(and positional tensor arguments: a model called with keyword arguments, the transformers
zoo, has no such arm). CUDA only: on a CPU there is nothing to compare with, and the
notebook says so instead of timing.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from replaykit.capturing import capture
from replaykit.step import TrainStep

from ..bench import network, timing
from . import MODELS, build, names, unavailable
from .run import AUTOCAST
from .workload import Loss, invoke

ARMS = ("eager", "make_graphed_callables", "replaykit", "replaykit step")


class StepArm(timing.TimedArm):
    """The same step as one ``rk.TrainStep`` over the arm's model and optimizer (its autocast,
    scaler, backward, SGD step and ``zero_grad`` inside the step)."""

    def __init__(
        self, name: str, model: torch.nn.Module, loss: Loss, precision: str, scaler, backend: str
    ) -> None:
        super().__init__(name, model, model, loss=loss, scaler=scaler)
        self.release = TrainStep(
            model,
            lambda m, args, targets: loss(invoke(m, args), targets),
            self.opt,
            scaler=scaler,
            precision=precision,
            backend=backend,
        )

    def step(self, batch) -> None:
        args, targets = batch
        self.release(args, targets)


def _context(
    device: torch.device, dtype: torch.dtype | None, cache: bool = True
) -> Callable[[], Any]:
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def _failed(size: str, arm: str, error: str) -> timing.ArmResult:
    return timing.ArmResult(
        size, arm, math.nan, math.nan, math.nan, math.nan, None, f"failed: {error}"
    )


def bench_model(
    name: str,
    precision: str,
    batch: int,
    device: torch.device,
    steps: int = 30,
    rounds: int = 5,
    warmup_steps: int = 5,
    backend: str = "auto",
    seed: int = 0,
) -> list[timing.ArmResult]:
    """Every arm for one model, precision and batch size (``size`` reads ``model/precision/b<batch>``)."""
    size = f"{name}/{precision}/b{batch}"
    why = unavailable(name)
    if why:
        return [_failed(size, arm, f"skipped: {why}") for arm in ARMS]
    dtype = AUTOCAST[precision]
    torch.manual_seed(seed)
    base, make_batch, loss = build(name)
    base = base.to(device).train()
    g = torch.Generator().manual_seed(1000 + seed)
    batches = [make_batch(batch, device, g) for _ in range(steps)]
    arms: list[timing.TimedArm] = []
    peaks: dict[str, tuple[float, float]] = {}
    out: list[timing.ArmResult] = []
    keywords = isinstance(batches[0][0], dict)
    for arm_name in ARMS:
        if arm_name == "make_graphed_callables" and (device.type != "cuda" or keywords):
            continue
        mem0 = timing.peak_reset(device)
        model = copy.deepcopy(base)
        scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        try:
            if arm_name == "make_graphed_callables":
                context = _context(device, dtype, cache=False)
                with (
                    context()
                ):  # its warm-up and capture run under the autocast it will be called in
                    call = torch.cuda.make_graphed_callables(
                        model, tuple(a.clone() for a in batches[0][0])
                    )
                arm = timing.TimedArm(
                    arm_name, model, call, loss=loss, context=context, scaler=scaler
                )
            elif arm_name == "replaykit step":
                arm = StepArm(arm_name, model, loss, precision, scaler, backend)
            elif arm_name == "replaykit":
                rec = capture(model, backend=backend, warmup=3)
                arm = timing.TimedArm(
                    arm_name,
                    model,
                    model,
                    release=rec,
                    loss=loss,
                    context=_context(device, dtype),
                    scaler=scaler,
                )
            else:
                arm = timing.TimedArm(
                    arm_name,
                    model,
                    model,
                    loss=loss,
                    context=_context(device, dtype),
                    scaler=scaler,
                )
            torch.manual_seed(seed + 1)  # every arm draws the same dropout masks as eager
            for b in batches[:warmup_steps]:
                arm.step(b)
            arm.keep_rng(device)
        except Exception as exc:  # one arm that cannot run is a row that says so
            out.append(_failed(size, arm_name, f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        timing.sync(device)
        peaks[arm_name] = timing.measure_peaks(device, mem0)
        arms.append(arm)
    if arms and arms[0].name == "eager":
        out = (
            list(timing.timed_results(size, arms, batches[warmup_steps:], rounds, device, peaks))
            + out
        )
    return out


def run(
    models: Iterable[str],
    precisions: Iterable[str] = ("32",),
    device: str | torch.device | None = None,
    steps: int = 30,
    rounds: int = 5,
    backend: str = "auto",
    progress: Callable[[timing.ArmResult], None] | None = None,
) -> list[timing.ArmResult]:
    """Every model × precision at each of its batches."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        from replaykit.verify.determinism import enable_determinism

        enable_determinism()  # each arm's end state is compared with eager's bit for bit
    results = []
    for name in names(models):
        for precision in precisions:
            for batch in MODELS[name].batches:
                for r in bench_model(
                    name, precision, batch, dev, steps=steps, rounds=rounds, backend=backend
                ):
                    results.append(r)
                    if progress:
                        progress(r)
    return results


def table(results: list[timing.ArmResult]) -> list[dict[str, Any]]:
    """:func:`replaykit.testing.bench.network.table` rows (ratios vs eager and vs make_graphed_callables), split
    into model, precision and batch; failed arms keep their row with the reason."""
    timed = [r for r in results if not r.note.startswith("failed:")]
    rows = network.table(timed) if timed else []
    rows += [
        {**{k: v for k, v in vars(r).items() if k != "step_ms"}}
        for r in results
        if r.note.startswith("failed:")
    ]
    for row in rows:
        model, precision, b = row["size"].split("/")
        row.update(model=model, precision=precision, batch=int(b[1:]))
    return rows


COLUMNS = (
    "model",
    "precision",
    "batch",
    "arm",
    "median_ms",
    "speedup_vs_eager",
    "time_vs_mgc",
    "peak_mib",
    "peak_reserved_mib",
    "reserved_vs_eager",
    "mem_vs_mgc",
    "equals_eager",
    "note",
)


REPLAYKIT_ARMS = ("replaykit", "replaykit step")


def _replays(note: str) -> int:
    """The replayed calls in a replaykit arm's note (``replays=N eager={...}``)."""
    match = re.match(r"replays=(\d+)", note or "")
    return int(match.group(1)) if match else 0


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """replaykit's ratios per row, whether it ended bitwise equal to eager everywhere, how many rows
    replayed (an arm that ran eagerly is timed but not a speedup), one line."""
    mine = [r for r in rows if r["arm"] in REPLAYKIT_ARMS]
    equal = all(r["equals_eager"] for r in mine if r.get("equals_eager") is not None)
    replayed = [r for r in mine if _replays(r.get("note", "")) > 0]
    parts = []
    for arm in REPLAYKIT_ARMS:
        ran = [r for r in mine if r["arm"] == arm]
        done = [r for r in replayed if r["arm"] == arm]
        timed = [r for r in done if r.get("speedup_vs_eager") == r.get("speedup_vs_eager")]
        best = max(timed, key=lambda r: r.get("speedup_vs_eager", 0.0), default=None)
        part = f"{arm}: {len(done)} of {len(ran)} rows replayed"
        if best is not None and "speedup_vs_eager" in best:
            part += f", best {best['speedup_vs_eager']:.2f}x eager ({best['size']})"
        parts.append(part)
    line = f"zoo bench: {'; '.join(parts)}; bitwise equal to eager: {equal}"
    return {
        "line": line,
        "replaykit_equal": equal,
        "replayed": len(replayed),
        "replaykit_rows": len(mine),
        "rows": rows,
    }
