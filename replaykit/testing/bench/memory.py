"""Peak memory of the replayed paths against eager's, each arm in a process of its own.

One process per (workload, arm): the caching allocator starts empty, so what an arm reserves is
its own (pools, static buffers, the recording call's snapshot and reference run), not what an
earlier arm left cached. Determinism is on, as for every parity run. The peak is taken over the
whole run from the first step (recording calls included), and separately over the steady replay
steps after the recording calls. Not a test: numbers are printed, never asserted.

    python -m replaykit.testing.bench.memory [--steps 12] [--json PATH] [--workload NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ARMS = ("eager", "step", "capture")


@dataclass(frozen=True)
class Workload:
    """A model, its batch and its loss: what one arm trains."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _mlp(depth: int, width: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class TinyLM(nn.Module):
    """Embedding, two pre-norm encoder layers with a causal mask, vocabulary head."""

    def __init__(self, vocab: int = 512, width: int = 128, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(
            width, 4, 4 * width, 0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.body(h, mask=self.mask, is_causal=True))


def _classify(
    batch: int, width: int
) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    return lambda g: (
        torch.randn(batch, width, generator=g),
        torch.randint(0, 10, (batch,), generator=g),
    )


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 512, (16, 65), generator=g)
    return t[:, :-1], t[:, 1:]


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "mlp16x256_b32", lambda: _mlp(16, 256), _classify(32, 256), nn.functional.cross_entropy
        ),
        Workload(
            "mlp8x1024_b256",
            lambda: _mlp(8, 1024),
            _classify(256, 1024),
            nn.functional.cross_entropy,
        ),
        Workload("tiny_lm", TinyLM, _tokens, _lm_loss),
    )
}


def _mib(n: int) -> float:
    return n / 2**20


def run_arm(workload: str, arm: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of one arm on CUDA; the peaks over the run and over its replays."""
    import replaykit as rk

    rk.enable_determinism()
    w, dev = WORKLOADS[workload], torch.device("cuda")
    torch.manual_seed(0)
    model = w.make().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=True)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(dev) for t in w.batch(g)) for _ in range(steps)]
    torch.cuda.synchronize()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    if arm == "step":
        run = rk.TrainStep(model, lambda m, x, y: w.loss(m(x), y), opt)
    elif arm == "capture":
        rec = rk.capture(model)
    steady_from = 3  # the recording calls (warm-up, record, check) are in the first three steps
    whole = (0, 0)
    for i, (x, y) in enumerate(batches):
        if i == steady_from:
            torch.cuda.synchronize()
            whole = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        if arm == "step":
            run(x, y)
        else:
            w.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    steady = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    counts = dict(run.counts) if arm == "step" else dict(rec.counts) if arm == "capture" else {}
    return {
        "workload": workload,
        "arm": arm,
        "peak_alloc_mib": _mib(max(whole[0], steady[0]) - base_alloc),
        "peak_reserved_mib": _mib(max(whole[1], steady[1]) - base_res),
        "steady_reserved_mib": _mib(steady[1] - base_res),
        "record": counts.get("record", 0),
        "replay": counts.get("replay", 0),
        "eager": counts.get("eager", 0),
    }


def _child(workload: str, arm: str, steps: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "replaykit.testing.bench.memory",
        "--child",
        workload,
        arm,
        "--steps",
        str(steps),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"workload": workload, "arm": arm, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def _ratio(row: dict[str, Any], eager: dict[str, Any] | None, key: str) -> str:
    return f"{row[key] / eager[key]:.2f}" if eager and eager[key] else "-"


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: each arm's peak reserved against eager's, over the run and steady."""
    eager = {r["workload"]: r for r in rows if r["arm"] == "eager" and "error" not in r}
    out = [
        "| workload | arm | peak reserved MiB | × eager | steady reserved MiB | × eager | peak allocated MiB | rec/rep/eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['arm']} | error: {r['error']} | | | | | |")
            continue
        e = eager.get(r["workload"])
        out.append(
            f"| {r['workload']} | {r['arm']} | {r['peak_reserved_mib']:.1f} | {_ratio(r, e, 'peak_reserved_mib')} | "
            f"{r['steady_reserved_mib']:.1f} | {_ratio(r, e, 'steady_reserved_mib')} | {r['peak_alloc_mib']:.1f} | "
            f"{r['record']}/{r['replay']}/{r['eager']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "ARM"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(run_arm(a.child[0], a.child[1], a.steps)))
        return 0
    if not torch.cuda.is_available():
        print("memory: needs CUDA (peak reserved memory is the caching allocator's)")
        return 2
    rows = [_child(w, arm, a.steps) for w in (a.workload or list(WORKLOADS)) for arm in ARMS]
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
