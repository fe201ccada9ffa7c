"""A ``torch.compile``'d model trained under replay against its compiled twin, bit for bit.

The twin is the same compiled model trained eagerly (``TrainStep(replay=False)`` or a plain loop),
so both sides run inductor's kernels; the twin runs twice to show it repeats itself (without
that, a replay difference could not be told from noise). ``entry="step"`` replays the whole step
(:class:`~replaykit.step.TrainStep`), ``entry="capture"`` the network (``rk.capture`` inside a
plain loop with ``accumulate`` micro-batches per optimizer step).

>>> r = trial(CompiledConfig(model="mlp", accumulate=2, device="cuda", backend="cuda"))
>>> r.equal, r.repeatable, r.counts
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ...capturing import capture
from ...step import TrainStep
from ...verify.bitwise import TensorDiff, diff_states
from .end_state import module_state, optimizer_state

_DTYPES = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class MLP(nn.Module):
    """``depth`` Linear+GELU layers of ``width``: the launch-bound model of the issue's table."""

    def __init__(self, depth: int = 2, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; attention written out (deterministic backward)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    """A small causal transformer language model (the issue's third row: 4 layers, d256)."""

    def __init__(self, layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (classes or vocabulary)."""
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


@dataclass
class CompiledConfig:
    """One cell of the exactness matrix; ``size`` is (depth, width) or (layers, d_model)."""

    model: str = "mlp"
    size: tuple[int, int] = (2, 32)
    batch: int = 8
    seq: int = 16
    accumulate: int = 1
    precision: str = "32"
    entry: str = "step"
    device: str = "cpu"
    backend: str = "emulated"
    compile: dict[str, Any] = field(default_factory=dict)
    steps: int = 3
    unsafe: tuple[str, ...] = ()
    vocab: int = 64
    repeat: bool = True  # run the twin twice (repeatability); off: one twin, ``repeatable`` None


@dataclass
class CompiledResult:
    """Replay against twin (``diffs``), twin against twin (``repeatable``), and the entry point."""

    equal: bool
    repeatable: bool | None
    diffs: list[TensorDiff]
    counts: dict[str, int]
    summary: str
    entry: Any


def make_model(cfg: CompiledConfig) -> nn.Module:
    torch.manual_seed(0)
    a, b = cfg.size
    model = (
        MLP(a, b)
        if cfg.model == "mlp"
        else CausalLM(a, b, heads=8 if b >= 256 else 4, vocab=cfg.vocab)
    )
    return model.to(cfg.device)


def batches(cfg: CompiledConfig, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        if cfg.model == "mlp":
            x = torch.randn(cfg.batch, cfg.size[1], generator=g)
            y = torch.randint(0, 10, (cfg.batch,), generator=g)
        else:
            x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
            y = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
        out.append((x.to(cfg.device), y.to(cfg.device)))
    return out


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Fused capturable AdamW on CUDA (the issue's table); SGD with momentum on the CPU (no capturable AdamW)."""
    if next(model.parameters()).is_cuda:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _run(cfg: CompiledConfig, base: nn.Module, replay: bool) -> tuple[dict, Any]:
    model = copy.deepcopy(base)
    compiled = torch.compile(model, **cfg.compile)
    opt = optimizer(model)
    data = batches(cfg, cfg.steps * cfg.accumulate)
    losses: list[torch.Tensor] = []
    entry: Any
    if cfg.entry == "step":
        entry = TrainStep(
            compiled,
            model_loss,
            opt,
            accumulate=cfg.accumulate,
            precision=cfg.precision,
            replay=replay,
            backend=cfg.backend,
            unsafe_disable=cfg.unsafe if replay else (),
        )
        losses = [entry(x, y) for x, y in data]
    else:
        entry = (
            capture(compiled, backend=cfg.backend, unsafe_disable=cfg.unsafe) if replay else None
        )
        dtype = _DTYPES[cfg.precision]
        for i, (x, y) in enumerate(data):
            autocast = (
                torch.autocast(cfg.device, dtype=dtype) if dtype is not None else nullcontext()
            )
            with autocast:
                loss = model_loss(compiled, x, y)
            (loss / cfg.accumulate if cfg.accumulate > 1 else loss).backward()
            losses.append(loss.detach().clone())
            if (i + 1) % cfg.accumulate == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
    state = {**module_state(model), **optimizer_state([opt])}
    state.update({f"loss/{i}": t.detach().cpu() for i, t in enumerate(losses)})
    return state, entry


def trial(cfg: CompiledConfig) -> CompiledResult:
    """Twin, twin again, then the replayed run, all from the same weights and batches."""
    base = make_model(cfg)
    twin, _ = _run(cfg, base, replay=False)
    again = _run(cfg, base, replay=False)[0] if cfg.repeat else None
    replayed, entry = _run(cfg, base, replay=True)
    diffs = diff_states(twin, replayed)
    return CompiledResult(
        equal=not diffs,
        repeatable=None if again is None else not diff_states(twin, again),
        diffs=diffs,
        counts=dict(entry.counts),
        summary=entry.summary(),
        entry=entry,
    )


def matrix(device: str = "cuda", backend: str = "cuda") -> list[dict[str, Any]]:
    """The exactness matrix: MLP and causal LM, accumulation 1/2/4, fp32 and bf16, both entry points."""
    rows = []
    for entry, model, acc, precision in itertools.product(
        ("step", "capture"), ("mlp", "lm"), (1, 2, 4), ("32", "bf16-mixed")
    ):
        cfg = CompiledConfig(
            model=model,
            entry=entry,
            accumulate=acc,
            precision=precision,
            device=device,
            backend=backend,
            steps=4,
        )
        t0 = time.perf_counter()
        torch._dynamo.reset()  # a fresh cache per cell: dynamo's recompile limit would fall back to eager
        try:
            r = trial(cfg)
            row = {
                "equal": r.equal,
                "repeatable": r.repeatable,
                "replays": r.counts["replay"],
                "first_diff": r.diffs[0].name if r.diffs else None,
                "summary": r.summary,
            }
        except Exception as exc:  # a cell that crashes is a row, not the end of the matrix
            row = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        row.update(model=model, entry=entry, accumulate=acc, precision=precision)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    from ...verify.determinism import enable_determinism

    enable_determinism()
    out = matrix()
    ok = sum(r["equal"] and r.get("repeatable", False) and r.get("replays", 0) > 0 for r in out)
    print(f"exact and replayed: {ok}/{len(out)}")
