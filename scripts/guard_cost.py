"""What two guards cost per call on this machine: the numbers docs/limits.md and CHANGELOG quote.

    OMP_NUM_THREADS=1 python scripts/guard_cost.py

- ``module_key`` of a teacher outside the model (a 12-layer ``TransformerEncoder`` stack, 121
  modules): the per-call read of a module code reaches outside every guarded tree.
- The module guard's per-call check (``lifecycle.guard.verdict()``) of a captured 2-layer GPT-2
  (skipped without transformers) and of a captured 100-block MLP (400 tensors).
Best of five timed runs; prints one line each; exits 0.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import replaykit as rk
from replaykit.guards.keys import module_key
from replaykit.testing.bench.overhead import network


def best_us(fn: Callable[[], object], calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def _guard_of(model: nn.Module, run: Callable[[], None]) -> Callable[[], object]:
    rk.capture(model, backend="emulated")
    for _ in range(4):
        run()
    return rk.recorder_of(model).lifecycle.guard.verdict


def main() -> int:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    teacher = nn.Sequential(*[layer.__class__(64, 4, 128, batch_first=True) for _ in range(12)])
    teacher.requires_grad_(False)
    n = len(list(teacher.modules()))
    print(
        f"module_key, outside teacher of {n} modules: {best_us(lambda: module_key(teacher), 200):.1f} us"
    )
    mlp = network(100)
    x = torch.randn(4, 8)
    verdict = _guard_of(mlp, lambda: mlp(x).sum().backward())
    print(f"module guard verdict, 100-block MLP: {best_us(verdict, 3000):.2f} us")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("module guard verdict, GPT-2: skipped (no transformers)")
        return 0
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    gpt2 = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    verdict = _guard_of(gpt2, lambda: gpt2(input_ids=ids, labels=ids).loss.backward())
    print(f"module guard verdict, 2-layer GPT-2: {best_us(verdict, 500):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
