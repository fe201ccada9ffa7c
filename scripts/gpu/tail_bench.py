"""What an eager optimizer step after the replayed network costs, side by side in one process.

    python scripts/gpu/tail_bench.py [--device cuda] [--steps 200] [--rounds 5]

Arms (ms per step, median of interleaved rounds; every replaying arm checked bitwise against its
own eager twin first): torch's default AdamW eager; ``rk.TrainStep`` with that default AdamW
(forward+backward replayed, the optimizer step eager after it); ``rk.TrainStep`` with
``AdamW(fused=True, capturable=True)`` (the whole step one graph); the same optimizer eager.
Sizes: launch-bound (MLP 8x256, batch 32) and medium (MLP 8x1024, batch 256).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import replaykit as rk

SIZES = {"launch-bound": (256, 32), "medium": (1024, 256)}


def _net(width: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(7):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers).to(device)


def _opt(kind: str, net: nn.Module, device: str) -> torch.optim.Optimizer:
    if kind == "default":
        return torch.optim.AdamW(net.parameters(), lr=1e-3)
    return torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True, capturable=device == "cuda")


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(m(x), y)


def _arm(kind: str, replay: bool, width: int, device: str) -> tuple[nn.Module, rk.TrainStep]:
    net = _net(width, device)
    step = rk.TrainStep(net, _loss, _opt(kind, net, device), replay=replay, max_norm=1.0)
    return net, step


def _batches(batch: int, device: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch, 64, generator=g).to(device),
            torch.randint(0, 10, (batch,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def _equal(kind: str, width: int, batch: int, device: str) -> tuple[bool, dict]:
    runs = []
    for replay in (True, False):
        net, step = _arm(kind, replay, width, device)
        for x, y in _batches(batch, device, 12):
            step(x, y)
        runs.append((net, step))
    (a, s), (b, _) = runs
    same = all(
        torch.equal(p, q)
        for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    return same, dict(s.counts)


def _time(step: rk.TrainStep, data: list, steps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda":
        rk.enable_determinism()
    print(f"torch {torch.__version__}, device {dev}")
    print("| size | arm | ms/step | bitwise vs its eager twin | counts |\n|---|---|---|---|---|")
    for size, (width, batch) in SIZES.items():
        arms = {
            "default AdamW, eager": ("default", False),
            "default AdamW, TrainStep (network replayed, step eager)": ("default", True),
            "fused capturable AdamW, eager": ("fused", False),
            "fused capturable AdamW, TrainStep (one graph)": ("fused", True),
        }
        checks = {k: _equal(kind, width, batch, dev) for k, (kind, rep) in arms.items() if rep}
        steps = {k: _arm(kind, rep, width, dev)[1] for k, (kind, rep) in arms.items()}
        data = _batches(batch, dev, 8)
        for s in steps.values():  # warm-up and recording
            for x, y in data:
                s(x, y)
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(args.rounds):
            for k, s in steps.items():
                times[k].append(_time(s, data, args.steps, dev))
        for k in arms:
            eq, counts = checks.get(k, (None, {}))
            mark = "-" if eq is None else str(eq)
            brief = {c: counts[c] for c in ("record", "replay", "eager") if c in counts}
            print(f"| {size} | {k} | {statistics.median(times[k]):.3f} | {mark} | {brief} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
