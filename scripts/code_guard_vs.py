#!/usr/bin/env python3
"""What the code guard (``ForwardInputs``) costs, this tree against another commit's, in one process.

    python scripts/code_guard_vs.py [--base main] [--rounds 9]

Loads the base commit's ``replaykit/guards/code.py`` beside this tree's and, round by round
(interleaved, so the machine's load falls on both alike), times for each model: building the
guard (once per ``rk.capture`` / ``rk.TrainStep``), its ``key()`` (every call, replayed or not)
and the first call under ``rk.capture`` (the recording call, emulated backend). Prints the
fastest round per arm: the least disturbed by other work. Models: the overhead bench's network
(torch's classes only: the guard is dropped, no per-call cost), a model reading a global through a
held schedule's method, and tiny GPT-2 and LLaMA from configs when transformers is installed."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import replaykit as rk  # noqa: E402
from replaykit import recorder  # noqa: E402
from replaykit.guards import code as this_tree  # noqa: E402
from replaykit.testing.bench.overhead import network  # noqa: E402

EPOCH = 0


class Schedule:
    def scale(self) -> float:
        return 1.0 + EPOCH


class Scheduled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.sched = nn.Linear(16, 16), Schedule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.sched.scale()


def _base(ref: str):
    source = subprocess.run(
        ["git", "show", f"{ref}:replaykit/guards/code.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "code_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("replaykit.guards.code_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]]:
    found = {
        "bench network": (lambda: network(20), lambda: torch.randn(4, 8)),
        "held schedule": (Scheduled, lambda: torch.randn(4, 16)),
    }
    try:
        import transformers
    except ImportError:
        return found
    transformers.logging.set_verbosity_error()
    tokens = lambda: torch.randint(3, 32, (2, 8))  # noqa: E731
    found["gpt2 tiny"] = (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16)
        ),
        tokens,
    )
    found["llama tiny"] = (
        lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=32,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=16,
                pad_token_id=0,
            )
        ),
        tokens,
    )
    return found


def _round(guard: type, make: Callable[[], nn.Module], data: Callable[[], torch.Tensor]):
    model = make()
    start = time.perf_counter()
    inputs = guard(model)
    build = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        inputs.key()
    key = (time.perf_counter() - start) / 100
    recorder.ForwardInputs = guard  # what rk.capture builds its guard with
    fresh, x = make(), data()
    with rk.capture(fresh, backend="emulated"):
        start = time.perf_counter()
        fresh(x)
        record = time.perf_counter() - start
    return len(inputs._sources), build, key, record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    arms = {"base": _base(args.base).ForwardInputs, "this": this_tree.ForwardInputs}
    print("| model | sources base / this | build ms | key() us per call | recording call ms |")
    print("|---|---|---|---|---|")
    try:
        for name, (make, data) in _models().items():
            runs: dict[str, list] = {arm: [] for arm in arms}
            for _ in range(args.rounds):
                for arm, guard in arms.items():
                    runs[arm].append(_round(guard, make, data))
            best = {arm: [min(r[i] for r in rows) for i in range(4)] for arm, rows in runs.items()}
            b, t = best["base"], best["this"]
            print(
                f"| {name} | {b[0]:.0f} / {t[0]:.0f} | {1e3 * b[1]:.1f} / {1e3 * t[1]:.1f} "
                f"| {1e6 * b[2]:.1f} / {1e6 * t[2]:.1f} | {1e3 * b[3]:.1f} / {1e3 * t[3]:.1f} |"
            )
    finally:
        recorder.ForwardInputs = this_tree.ForwardInputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
