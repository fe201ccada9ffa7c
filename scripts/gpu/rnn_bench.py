"""Recurrent nets on CUDA (issue #33 class 2): an LSTM language model and a bidirectional GRU
sequence classifier, each step timed under five arms side by side in one process:

  eager     the plain loop (zero_grad, forward, loss, backward, optimizer step)
  step      rk.TrainStep over the same model, loss and optimizer
  capture   rk.capture(model) with the plain loop around it
  compile   torch.compile(model, mode="reduce-overhead") with the plain loop (dynamo falls back on nn.LSTM)
  raw       PyTorch's whole-step torch.cuda.graph recipe (forward, backward, optimizer in one graph)
  graphed   torch.cuda.make_graphed_callables(model) with the plain loop: the raw floor of
            rk.capture's scope (the network's forward and backward; loss and optimizer eager)

Run from the repository root:  python scripts/gpu/rnn_bench.py [--quick] [--no-compile]
Prints one markdown table (and writes it to $OUT/rnn_table.md when OUT is set): per workload and arm,
ms per step (CUDA events, the median of ``ROUNDS`` rounds, the arms interleaved), the ratio to the raw
graph, whether its parameters end bitwise equal to eager's (a fresh run of ``EXACT_STEPS`` steps per
arm from the same seed, so cuDNN's dropout state and the CUDA generator start alike), and the journal's
record/replay/eager counts with the main eager reason. Stops starting workloads after 200 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.getcwd())

import torch
from torch import nn

import replaykit as rk

ROUNDS, STEPS_PER_ROUND, EXACT_STEPS, BUDGET_S = 5, 20, 8, 200


class LanguageModel(nn.Module):
    """Embedding -> 2-layer LSTM -> vocabulary head (next-token loss)."""

    def __init__(self, vocab: int, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, hidden, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


class Classifier(nn.Module):
    """Embedding -> bidirectional GRU -> mean over time -> class head."""

    def __init__(self, vocab: int, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layers = 2 if dropout else 1
        self.rnn = nn.GRU(
            width, hidden, num_layers=layers, dropout=dropout, batch_first=True, bidirectional=True
        )
        self.head = nn.Linear(2 * hidden, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0].mean(1))


def lm_loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), target.flatten())


def cls_loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float(), target)


class Workload:
    def __init__(self, name: str, prec: str, dropout: float, quick: bool, device: str) -> None:
        self.name, self.prec, self.dropout, self.device = name, prec, dropout, device
        lm = name == "lstm_lm"
        self.vocab = 1000 if not quick else 50
        self.width, self.hidden = (256, 512) if lm else (128, 256)
        if quick:
            self.width, self.hidden = 16, 32
        self.batch, self.seq = (32, 64) if not quick else (4, 8)
        self.loss = lm_loss if lm else cls_loss
        self.cls = LanguageModel if lm else Classifier
        g = torch.Generator().manual_seed(0)
        self.batches = []
        for _ in range(8):
            tokens = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
            target = (
                torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
                if lm
                else torch.randint(0, 10, (self.batch,), generator=g)
            )
            self.batches.append((tokens.to(device), target.to(device)))

    @property
    def label(self) -> str:
        return f"{self.name} {self.prec}" + (f" dropout {self.dropout}" if self.dropout else "")

    def model(self) -> nn.Module:
        torch.manual_seed(0)  # also re-seeds cuDNN's dropout state at its next use: each arm alike
        return self.cls(self.vocab, self.width, self.hidden, self.dropout).to(self.device)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        cuda = self.device == "cuda"
        return torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=cuda, foreach=True)

    def autocast(self, cache: bool = True) -> Any:
        if self.prec == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=cache)


class Arm:
    """One way of running the step: ``step(batch)``; ``runner`` has a journal where it is replaykit."""

    def __init__(self, name: str, w: Workload) -> None:
        self.name, self.w = name, w
        self.model = w.model()
        self.opt = w.optimizer(self.model)
        self.runner: Any = None
        self.call: Callable[..., Any] = self._build()

    def _plain(self, model: nn.Module, cache: bool = True) -> Callable[..., Any]:
        w, opt = self.w, self.opt

        def step(tokens: torch.Tensor, target: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            with w.autocast(cache):
                loss = w.loss(model, tokens, target)
            loss.backward()
            opt.step()

        return step

    def _build(self) -> Callable[..., Any]:
        w = self.w
        if self.name == "eager":
            return self._plain(self.model)
        if self.name == "step":
            precision = {"fp32": "32", "bf16": "bf16-mixed"}[w.prec]
            self.runner = rk.TrainStep(self.model, w.loss, self.opt, precision=precision)
            return self.runner
        if self.name == "capture":
            self.runner = rk.capture(self.model)
            return self._plain(self.model)
        if self.name == "compile":
            return self._plain(torch.compile(self.model, mode="reduce-overhead"))
        if self.name == "graphed":
            with w.autocast(cache=False):
                graphed = torch.cuda.make_graphed_callables(self.model, (w.batches[0][0],))
            return self._plain(graphed, cache=False)
        return self._raw()

    def _raw(self) -> Callable[..., Any]:
        """The whole step captured once; the warm-up's updates are undone so it starts where eager does."""
        w, model, opt = self.w, self.model, self.opt
        static = [t.clone() for t in w.batches[0]]
        start = [p.detach().clone() for p in model.parameters()]

        def body() -> None:
            with w.autocast(cache=False):
                loss = w.loss(model, *static)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        with torch.no_grad():  # AdamW's state at zero is its state before a first step
            for p, s in zip(model.parameters(), start, strict=True):
                p.copy_(s)
            for state in opt.state.values():
                for t in state.values():
                    if isinstance(t, torch.Tensor):
                        t.zero_()

        def step(tokens: torch.Tensor, target: torch.Tensor) -> None:
            static[0].copy_(tokens)
            static[1].copy_(target)
            graph.replay()

        return step

    def run(self, steps: int, start: int = 0) -> None:
        for i in range(start, start + steps):
            self.call(*self.w.batches[i % len(self.w.batches)])

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def journal(self) -> str:
        if self.runner is None:
            return "-"
        c = self.runner.counts
        reasons = self.runner.eager_reasons.most_common(1)
        why = f" ({reasons[0][0][:60]})" if reasons else ""
        if getattr(self.runner, "retired", False):
            why = f" retired: {str(self.runner.retire_reason)[:70]}"
        return f"rec {c['record']} rep {c['replay']} eager {c['eager']}{why}"


def time_arms(arms: list[Arm]) -> dict[str, float]:
    """ms per step per arm: CUDA events around ``STEPS_PER_ROUND`` steps, the arms interleaved, median of rounds."""
    per: dict[str, list[float]] = {a.name: [] for a in arms}
    cuda = arms[0].w.device == "cuda"
    for r in range(ROUNDS):
        for a in arms:
            if cuda:
                begin, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize()
                begin.record()
                a.run(STEPS_PER_ROUND, r * STEPS_PER_ROUND)
                end.record()
                torch.cuda.synchronize()
                per[a.name].append(begin.elapsed_time(end) / STEPS_PER_ROUND)
            else:
                t0 = time.perf_counter()
                a.run(STEPS_PER_ROUND, r * STEPS_PER_ROUND)
                per[a.name].append((time.perf_counter() - t0) * 1e3 / STEPS_PER_ROUND)
    return {k: statistics.median(v) for k, v in per.items()}


def bench(w: Workload, arm_names: list[str]) -> list[dict[str, Any]]:
    arms, rows, reference = [], [], None
    for name in arm_names:  # each fresh from seed 0 and run alone: its exactness
        t0 = time.perf_counter()
        try:
            arm = Arm(name, w)
            arm.run(EXACT_STEPS)
            if w.device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            rows.append({"arm": name, "error": f"{type(e).__name__}: {str(e)[:100]}"})
            traceback.print_exc(limit=2)
            continue
        final = arm.params()
        if name == "eager":
            reference = final
        exact = reference is not None and all(
            torch.equal(a, b) for a, b in zip(reference, final, strict=True)
        )
        arms.append(arm)
        rows.append(
            {
                "arm": name,
                "exact": exact,
                "journal": arm.journal(),
                "setup_s": time.perf_counter() - t0,
            }
        )
    times = time_arms(arms) if arms else {}
    raw, graphed = times.get("raw"), times.get("graphed")
    for row in rows:
        ms = times.get(row["arm"])
        row["ms"] = ms
        row["vs_raw"] = ms / raw if ms is not None and raw else None
        row["vs_graphed"] = ms / graphed if ms is not None and graphed else None
        if row["arm"] != "eager" and "error" not in row:
            row["journal"] = next(a for a in arms if a.name == row["arm"]).journal()
    return rows


def markdown(results: list[tuple[str, list[dict[str, Any]]]], header: str) -> str:
    lines = [
        header,
        "",
        "| workload | arm | ms/step | × raw graph | × graphed | exact | journal |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in results:
        for r in rows:
            if "error" in r:
                lines.append(f"| {label} | {r['arm']} | - | - | - | - | error: {r['error']} |")
                continue
            ms = f"{r['ms']:.2f}" if r.get("ms") is not None else "-"
            vs = f"{r['vs_raw']:.2f}" if r.get("vs_raw") is not None else "-"
            vg = f"{r['vs_graphed']:.2f}" if r.get("vs_graphed") is not None else "-"
            exact = "yes" if r["exact"] else "NO"
            lines.append(
                f"| {label} | {r['arm']} | {ms} | {vs} | {vg} | {exact} | {r['journal']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check of the script)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    rk.enable_determinism()
    header = (
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; "
        f"{ROUNDS} rounds x {STEPS_PER_ROUND} steps, exactness over {EXACT_STEPS} fresh steps"
    )
    print(header, flush=True)
    workloads = [
        ("lstm_lm", "fp32", 0.0, True),
        ("gru_cls", "fp32", 0.0, True),
        ("lstm_lm", "bf16", 0.0, False),
        ("gru_cls", "bf16", 0.0, False),
        ("lstm_lm", "fp32", 0.2, False),
        ("gru_cls", "bf16", 0.2, False),
        ("lstm_lm", "bf16", 0.2, False),
    ]
    results = []
    t0 = time.perf_counter()
    for name, prec, dropout, compiled in workloads:
        w = Workload(name, prec, dropout, args.quick, args.device)
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"{w.label}: skipped (budget)", flush=True)
            continue
        arm_names = ["eager", "step", "capture"]
        if args.device == "cuda":
            arm_names += ["compile"] if compiled and not args.no_compile else []
            # make_graphed_callables over a cuDNN dropout RNN ended in an illegal memory access on
            # the H200 (torch 2.11): dropout rows leave that floor out
            arm_names += ["raw"] if dropout else ["graphed", "raw"]
        rows = bench(w, arm_names)
        results.append((w.label, rows))
        print(
            "\n".join(markdown([(w.label, rows)], "").strip().splitlines()[-len(rows) :]),
            flush=True,
        )
    text = markdown(results, header)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "rnn_table.md"), "w") as f:
            f.write(text)
    print(f"total {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
