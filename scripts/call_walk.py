"""The walk of one call through the core: which modules it visits and how often it changes module.

    python scripts/call_walk.py [--backend emulated]

Issue #32's measure of how tangled the recording call is: a Python profile hook follows one
call of ``rk.capture`` and one of ``rk.TrainStep`` (the recording call, then a replayed call)
and counts, among the core's modules (``replaykit/`` less testing, workflow, integrations and
lightning), the distinct modules entered and the changes of module from one Python event to the
next (a call into another module, and the return from it, are two changes). It prints one
row per call; exits 0. Library code outside the core (torch, the user's model) is skipped: a
change is counted between consecutive core frames only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import replaykit as rk

ROOT = Path(rk.__file__).resolve().parent
EXTRAS = ("testing", "workflow", "integrations", "lightning")


def _core_module(filename: str) -> str | None:
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] in EXTRAS:
        return None
    return ".".join(rel.with_suffix("").parts)


def walk(call: Callable[[], Any]) -> tuple[set[str], int]:
    """The core modules ``call`` enters and its changes of module."""
    seen: set[str] = set()
    changes = 0
    last: list[str | None] = [None]
    cache: dict[str, str | None] = {}

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal changes
        if event not in ("call", "return"):
            return
        name = frame.f_code.co_filename
        module = cache[name] if name in cache else cache.setdefault(name, _core_module(name))
        if module is None:
            return
        seen.add(module)
        if last[0] is not None and last[0] != module:
            changes += 1
        last[0] = module

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen, changes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _capture_calls(backend: str) -> list[tuple[str, Callable[[], Any]]]:
    model = _net()
    rk.capture(model, backend=backend)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def one() -> None:
        nn.functional.cross_entropy(model(x), y).backward()

    return [("capture: recording call", one), ("capture: replayed call", one)]


def _step_calls(backend: str) -> list[tuple[str, Callable[[], Any]]]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
    step = rk.TrainStep(
        net, lambda m, x, y: nn.functional.cross_entropy(m(x), y), opt, backend=backend
    )
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step(x, y)  # the step's warm-up call runs eagerly; the second records
    return [
        ("step: recording call", lambda: step(x, y)),
        ("step: replayed call", lambda: step(x, y)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="emulated")
    parser.add_argument("--modules", action="store_true", help="list the modules of each call")
    args = parser.parse_args(argv)
    print("| call | core modules entered | changes of module |\n|---|---|---|")
    for label, call in _capture_calls(args.backend) + _step_calls(args.backend):
        seen, changes = walk(call)
        print(f"| {label} | {len(seen)} | {changes} |")
        if args.modules:
            print("|  | " + ", ".join(sorted(seen)) + " | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
