"""Zoo step times: eager vs ``torch.cuda.make_graphed_callables`` vs replaykit, per model × precision × batch.

The arms and their interleaved timing are :mod:`replaykit.testing.bench.timing`'s; a zoo step is
forward, the model's loss, backward (a GradScaler for ``16-mixed``), SGD step and
``zero_grad``, at each model's small and medium batch (``ZooModel.batches``). Autocast
runs with its cast cache on for eager and replaykit, as users write it, and off for
``make_graphed_callables``, which requires that. CUDA only: on a CPU there is nothing
to compare with, and the notebook says so instead of timing.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from replaykit.recorder import capture

from ..bench import network, timing
from . import MODELS, build, names, unavailable
from .run import AUTOCAST

ARMS = ("eager", "make_graphed_callables", "replaykit")


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
    for arm_name in ARMS:
        if arm_name == "make_graphed_callables" and device.type != "cuda":
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
    """Every model × precision at its small and medium batch."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        from replaykit.determinism import enable_determinism

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


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """replaykit's ratios per row, whether it ended bitwise equal to eager everywhere, one line."""
    mine = [r for r in rows if r["arm"] == "replaykit"]
    equal = all(r["equals_eager"] for r in mine if r.get("equals_eager") is not None)
    timed = [
        r
        for r in mine
        if r.get("speedup_vs_eager") == r.get("speedup_vs_eager") and "speedup_vs_eager" in r
    ]
    best = max(timed, key=lambda r: r["speedup_vs_eager"], default=None)
    line = f"zoo bench: {len(mine)} replaykit rows; bitwise equal to eager: {equal}"
    if best:
        line += f"; best {best['speedup_vs_eager']:.2f}x eager ({best['size']})"
    return {"line": line, "replaykit_equal": equal, "rows": rows}
