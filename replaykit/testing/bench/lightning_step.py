"""Lightning whole-step timing: ``Trainer.fit`` step times of Lightning's own floor (a one-parameter
model), automatic optimization eager, with network replay (``ReplayCallback``) and with the
optimizer step replayed too (``ReplayCallback(..., optimizer_step=True)``), and manual
optimization with the whole step replayed (:func:`replaykit.lightning.whole_step`).

The issue's target reads: step time ≤ floor + 1.2 × the raw whole-step graph time, for the
manual whole step and for the replayed automatic step. On CUDA the raw graph (PyTorch's
whole-step capture recipe, :func:`replaykit.testing.bench.step.raw_graph`) is timed in the same
run (``raw step graph``). Step times come from a callback that synchronizes and stamps every
``on_train_batch_end``; the median of the steady steps counts. Not a test: timings are never
asserted.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from ...lightning import ReplayCallback, whole_step
from ..nets import DetectionNet
from .step import raw_graph
from .timing import Size, heads_loss

AUTOMATIC = "lightning + replayed automatic step"
ARMS = (
    "lightning floor",
    "lightning eager",
    "lightning + network replay",
    AUTOMATIC,
    "lightning + whole step",
)
RAW = "raw step graph"


class Stamps(L.Callback):
    """A synchronized timestamp at every ``on_train_batch_end``: step times from their differences."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t.append(time.perf_counter())


class AutoModule(L.LightningModule):
    """Automatic optimization of ``net``: the heads' loss, SGD with momentum (fused on CUDA)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return heads_loss(self.net(batch[0]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(
            self.net.parameters(), lr=0.01, momentum=0.9, fused=next(self.parameters()).is_cuda
        )


class _Floor(AutoModule):
    """One parameter: what Lightning's loop costs per step by itself."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.net.weight * batch[0].mean()).square().sum()


class _Whole(AutoModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.automatic_optimization = False

    def on_train_start(self) -> None:
        self.step = whole_step(self, self.net, lambda net, x: heads_loss(net(x)))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.step(batch[0])


def fit_step_ms(
    module: L.LightningModule,
    data: torch.Tensor,
    device: str,
    callbacks: list,
    **trainer_args: Any,
) -> list[float]:
    """One epoch over ``data``'s batches; the steady step times in ms (the first fifth, which
    records, left out). ``trainer_args`` replace the single-device layout (``devices=1``)."""
    stamps = Stamps()
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="gpu" if device == "cuda" else "cpu",
        **({"devices": 1} | trainer_args),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[stamps, *callbacks],
    )
    # a list of batches, as a loader yields them (a slice of one preloaded tensor has a new
    # storage offset each step, which network replay keys: one recording per offset)
    trainer.fit(module, DataLoader([(x.clone(),) for x in data], batch_size=None))
    steps = [(b - a) * 1e3 for a, b in zip(stamps.t, stamps.t[1:], strict=False)]
    return steps[len(steps) // 5 :]  # the first fifth warms up (records)


def _raw_ms(net: nn.Module, data: torch.Tensor) -> float:
    """Median ms of one replay of the whole step captured raw (CUDA only), synchronized per step
    like the Lightning arms."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True)
    step = raw_graph(net, opt, data[0])
    times = []
    for x in data:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[len(times) // 5 :])


def run(size: Size, device: str = "cuda", steps: int = 100) -> list[dict[str, Any]]:
    """Median step ms per arm (same batches, same initial weights); on CUDA also the raw graph."""
    torch.manual_seed(0)
    base = DetectionNet(width=size.width, depth=size.depth)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(steps, size.batch, 3, size.image, size.image, generator=g).to(device)
    out = []
    for arm in ARMS:
        net = DetectionNet(width=size.width, depth=size.depth)
        net.load_state_dict(base.state_dict())
        if arm == "lightning floor":
            module, cbs = _Floor(nn.Linear(1, 1, bias=False)), []
        elif arm == "lightning eager":
            module, cbs = AutoModule(net), []
        elif arm == "lightning + network replay":
            cb = ReplayCallback("net")
            module, cbs = AutoModule(net), [cb]
        elif arm == AUTOMATIC:
            cb = ReplayCallback("net", optimizer_step=True)
            module, cbs = AutoModule(net), [cb]
        else:
            module, cbs = _Whole(net), []
        t = fit_step_ms(module, data, device, cbs)
        row = {"size": size.name, "arm": arm, "median_ms": statistics.median(t), "steps": len(t)}
        if arm in (AUTOMATIC, "lightning + network replay"):  # what replayed, and why not
            summary = cb.summary()
            row["net_replays"] = summary["net"]["replay"]
            row["net_eager"] = summary["net"].get("eager_reasons", {})
            if arm == AUTOMATIC:
                row["step_replays"] = summary["optimizer_step"]["replay"]
        out.append(row)
    if device == "cuda":
        net = DetectionNet(width=size.width, depth=size.depth).to(device)
        net.load_state_dict(base.state_dict())
        raw = _raw_ms(net, data)
        out.append({"size": size.name, "arm": RAW, "median_ms": raw, "steps": steps})
    return out


def summary(rows: list[dict[str, Any]], raw_graph_ms: float | None = None) -> dict[str, Any]:
    """One line per size: every arm, and the target (floor + 1.2 x raw graph) for the manual whole
    step and the replayed automatic step; ``raw_graph_ms`` defaults to the run's own raw row."""
    by = {r["arm"]: r["median_ms"] for r in rows}
    if raw_graph_ms is None:
        raw_graph_ms = by.get(RAW)
    line = (
        f"lightning {rows[0]['size']}: floor {by['lightning floor']:.3f} ms, eager {by['lightning eager']:.3f} ms, "
        f"network replay {by['lightning + network replay']:.3f} ms, replayed automatic step "
        f"{by[AUTOMATIC]:.3f} ms, whole step {by['lightning + whole step']:.3f} ms"
    )
    target = None
    if raw_graph_ms is not None:
        target = by["lightning floor"] + 1.2 * raw_graph_ms
        verdicts = ", ".join(
            f"{name} {'met' if by[arm] <= target else f'missed by {by[arm] - target:.3f} ms'}"
            for name, arm in (("whole step", "lightning + whole step"), ("automatic", AUTOMATIC))
        )
        line += f"; target floor + 1.2 x raw graph ({raw_graph_ms:.3f} ms) = {target:.3f} ms: {verdicts}"
    return {"line": line, "target_ms": target, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """``python -m replaykit.testing.bench.lightning_step [--sizes launch-bound,medium] [--json out]``"""
    import argparse
    import json

    from .timing import SIZES

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="launch-bound,medium")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the rows and lines here")
    args = ap.parse_args(argv)
    if args.device == "cuda":  # eager must repeat itself, or each recording's check refuses it
        from ...verify.determinism import enable_determinism

        enable_determinism()
    sizes = [s for s in SIZES if s.name in args.sizes.split(",")]
    results = []
    for size in sizes:
        rows = run(size, args.device, args.steps)
        results.append(summary(rows))
        print(results[-1]["line"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
