"""``rk.TrainStep`` over a ``torch.compile``'d model against what a user would pick instead:
``torch.compile(model, mode="reduce-overhead")``.

Arms, one model each from the same weights, the same batches, interleaved rounds (ms per
micro-batch call; at ``accumulate=1`` one training step): ``eager``, ``TrainStep``,
``compile(reduce-overhead)``, ``compile(default)``, ``TrainStep(compile)``. A step is forward,
cross-entropy, backward and fused capturable AdamW. ``compile(reduce-overhead)`` raises under
gradient accumulation (its graphs' outputs are overwritten by the next micro-batch,
pytorch/pytorch#169545): the error is the row's note, not a crash. Exactness: ``TrainStep``
against ``eager`` and ``TrainStep(compile)`` against ``compile(default)`` (its twin), bit for bit.
Not a test: timings are never asserted.

    python -m replaykit.testing.bench.compiled --accumulate 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ...step import TrainStep
from ...verify.bitwise import diff_states
from ..parity.compiled_trial import CompiledConfig, batches, make_model, optimizer
from ..parity.end_state import module_state, optimizer_state

ARMS = (
    "eager",
    "TrainStep",
    "compile(reduce-overhead)",
    "compile(default)",
    "TrainStep(compile)",
)
#: each arm's exactness reference
REFERENCE = {"TrainStep": "eager", "TrainStep(compile)": "compile(default)"}

#: the issue's table: MLP 16x256 batch 32, MLP 8x1024 batch 512, causal LM 4 layers d256 8x128 tokens
SIZES: dict[str, CompiledConfig] = {
    "MLP 16x256 b32": CompiledConfig(model="mlp", size=(16, 256), batch=32),
    "MLP 8x1024 b512": CompiledConfig(model="mlp", size=(8, 1024), batch=512),
    "LM 4L d256 8x128": CompiledConfig(model="lm", size=(4, 256), batch=8, seq=128, vocab=4096),
}


@dataclass
class Row:
    size: str
    arm: str
    accumulate: int
    median_ms: float | None
    ratio_vs_reduce_overhead: float | None
    equal_to: str | None
    equal: bool | None
    note: str


class _Work:
    """What every arm trains: a base model, its batches as ``(args, targets)`` and the loss of ``model(*args)``."""

    def __init__(self, model: nn.Module, data: list[tuple[tuple, Any]], loss: Callable) -> None:
        self.model, self.data, self.loss = model, data, loss
        self.step_loss = _step_loss(loss)


def _step_loss(loss: Callable) -> Callable[..., torch.Tensor]:
    """``TrainStep``'s ``loss_fn``: the batch is the model's arguments, then the targets. A closure
    over ``loss`` alone: a bound method of the object holding every batch would have the step key
    that whole list at every call (what ``loss_fn`` can read): 0.2 ms for 54 batches on a CPU."""

    def step_loss(model: nn.Module, *batch: Any) -> torch.Tensor:
        return loss(model(*batch[:-1]), batch[-1])

    return step_loss


def _loop(
    work: _Work, call: Callable[..., Any], opt: torch.optim.Optimizer, acc: int
) -> Callable[..., Any]:
    n = [0]

    def step(*batch: Any) -> None:
        loss = work.loss(call(*batch[:-1]), batch[-1])
        (loss / acc if acc > 1 else loss).backward()
        n[0] += 1
        if n[0] % acc == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def _arm(name: str, work: _Work, model: nn.Module, acc: int) -> tuple[Callable[..., Any], Any]:
    opt = optimizer(model)
    if name == "eager":
        return _loop(work, model, opt, acc), opt
    if name == "compile(reduce-overhead)":
        return _loop(work, torch.compile(model, mode="reduce-overhead"), opt, acc), opt
    if name == "compile(default)":
        return _loop(work, torch.compile(model), opt, acc), opt
    target = torch.compile(model) if name == "TrainStep(compile)" else model
    step = TrainStep(target, work.step_loss, opt, accumulate=acc)
    return step, opt


class _Rng:
    """One arm's generator states (CPU, and CUDA's default), swapped in around its calls."""

    def __init__(self, device: str) -> None:
        torch.manual_seed(2)
        self.cuda = device == "cuda"
        self.state = self._get()

    def _get(self) -> tuple:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None

    def __enter__(self) -> None:
        self.saved = self._get()
        torch.set_rng_state(self.state[0])
        if self.cuda:
            torch.cuda.set_rng_state(self.state[1])

    def __exit__(self, *exc: object) -> None:
        self.state = self._get()
        torch.set_rng_state(self.saved[0])
        if self.cuda:
            torch.cuda.set_rng_state(self.saved[1])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_size(
    label: str,
    cfg: CompiledConfig | str,
    accumulate: int,
    warmup: int = 4,
    rounds: int = 5,
    per: int = 10,
    device: str = "cuda",
    batch: int = 8,
    names: tuple[str, ...] = ARMS,
) -> list[Row]:
    """Every arm at one size (a :class:`CompiledConfig`, or a zoo model's name at ``batch``);
    ``warmup`` optimizer steps (compilation, recording) are not timed. ``device="cpu"`` is a
    smoke run (emulated TrainStep; the compiled arms run eagerly there)."""
    torch._dynamo.reset()  # a fresh cache per size: dynamo's recompile limit would fall back to eager
    n = (warmup + rounds * per) * accumulate
    if isinstance(cfg, str):
        from ..zoo import build

        torch.manual_seed(0)
        module, make_batch, loss = build(cfg)
        g = torch.Generator().manual_seed(1)
        work = _Work(module.to(device), [make_batch(batch, device, g) for _ in range(n)], loss)
    else:
        cfg = copy.copy(cfg)
        cfg.accumulate, cfg.device = accumulate, device
        work = _Work(make_model(cfg), [((x,), y) for x, y in batches(cfg, n)], model_loss_out)
    base, data = work.model, [(*args, targets) for args, targets in work.data]
    arms: dict[str, tuple[Callable, torch.optim.Optimizer, nn.Module]] = {}
    notes: dict[str, str] = {}
    rng: dict[
        str, _Rng
    ] = {}  # each arm draws its own random numbers (dropout) across interleaved rounds
    for name in names:
        model = copy.deepcopy(base)
        rng[name] = _Rng(device)
        try:
            call, opt = _arm(name, work, model, accumulate)
            with rng[name]:
                for b in data[: warmup * accumulate]:
                    call(*b)
            _sync(device)
            arms[name] = (call, opt, model)
        except Exception as exc:  # reduce-overhead under accumulation: the table says so
            notes[name] = f"raises: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    times: dict[str, list[float]] = {n: [] for n in arms}
    timed = data[warmup * accumulate :]
    chunk = per * accumulate
    for r in range(rounds):
        for name, (call, _, _) in list(arms.items()):
            try:
                with rng[name]:
                    _sync(device)
                    t0 = time.perf_counter()
                    for b in timed[r * chunk : (r + 1) * chunk]:
                        call(*b)
                    _sync(device)
                    times[name].append((time.perf_counter() - t0) * 1e3 / chunk)
            except Exception as exc:
                notes[name] = f"raises: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                del arms[name]
    states = {n: {**module_state(m), **optimizer_state([o])} for n, (_, o, m) in arms.items()}
    medians = {n: statistics.median(t) for n, t in times.items() if t and n in arms}
    ro = medians.get("compile(reduce-overhead)")
    rows = []
    for name in names:
        ref = REFERENCE.get(name)
        equal = None
        if ref is not None and name in states and ref in states:
            equal = not diff_states(states[ref], states[name])
        note = notes.get(name, "")
        call = arms.get(name, (None,))[0]
        if isinstance(call, TrainStep):
            note = (note + " " + call.summary()).strip()
        med = medians.get(name)
        rows.append(
            Row(
                label,
                name,
                accumulate,
                med,
                None if med is None or ro is None else med / ro,
                ref,
                equal,
                note,
            )
        )
    return rows


def model_loss_out(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension of the model's output."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def run(
    accumulates: tuple[int, ...] = (1, 2),
    sizes: dict[str, CompiledConfig] = SIZES,
    zoo: tuple[str, ...] = (),
    zoo_batch: int = 32,
    arms: tuple[str, ...] = ARMS,
    device: str = "cuda",
    **timing: int,
) -> list[Row]:
    """The issue's sizes, then zoo models (``replaykit.testing.zoo.MODELS`` names) at ``zoo_batch``;
    ``timing``: :func:`bench_size`'s ``warmup``, ``rounds``, ``per``."""
    out = []
    for acc in accumulates:
        for label, cfg in sizes.items():
            out += bench_size(label, cfg, acc, names=arms, device=device, **timing)
        for name in zoo:
            out += bench_size(
                f"{name} b{zoo_batch}",
                name,
                acc,
                batch=zoo_batch,
                names=arms,
                device=device,
                **timing,
            )
    return out


def markdown(rows: list[Row]) -> str:
    lines = [
        "| size | acc | arm | ms/call | vs reduce-overhead | exact vs | equal | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = "—" if r.median_ms is None else f"{r.median_ms:.3f}"
        ratio = "" if r.ratio_vs_reduce_overhead is None else f"{r.ratio_vs_reduce_overhead:.2f}"
        lines.append(
            f"| {r.size} | {r.accumulate} | {r.arm} | {ms} | {ratio} | {r.equal_to or ''} | "
            f"{'' if r.equal is None else r.equal} | {r.note} |"
        )
    return "\n".join(lines)


def run_isolated(
    accumulates: tuple[int, ...] = (1, 2),
    sizes: tuple[str, ...] = tuple(SIZES),
    zoo: tuple[str, ...] = (),
    arms: tuple[str, ...] = ARMS,
    device: str = "cuda",
    **timing: int,
) -> list[Row]:
    """:func:`run`, one process per accumulation and size (a size's arms side by side within it).

    On the H200 (torch 2.11) a second size started in a process whose first size ran
    reduce-overhead's CUDA graphs beside replaykit's crashed with an illegal memory access at its
    first CUDA call (not under ``CUDA_LAUNCH_BLOCKING=1``, nor with one size per process): not
    diagnosed. A process that fails leaves rows saying so.
    """
    import os
    import subprocess
    import sys
    import tempfile

    import replaykit

    root = str(
        pathlib.Path(replaykit.__file__).resolve().parents[1]
    )  # the tree the caller imported
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    jobs = [("--sizes", k) for k in sizes] + [("--zoo", z) for z in zoo]
    rows: list[Row] = []
    for acc in accumulates:
        for flag, name in jobs:
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "rows.json"
                cmd = [
                    sys.executable,
                    "-m",
                    "replaykit.testing.bench.compiled",
                    "--accumulate",
                    str(acc),
                    flag,
                    name,
                ]
                cmd += ["--zoo"] if flag == "--sizes" else ["--sizes"]
                cmd += ["--arms", *arms, "--json", str(out), "--one-process", "--device", device]
                cmd += [f"--{k}={v}" for k, v in timing.items()]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0 or not out.exists():
                    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
                    label = name if flag == "--sizes" else f"{name} b32"
                    rows += [
                        Row(label, a, acc, None, None, None, None, f"crashed: {tail}") for a in arms
                    ]
                    continue
                rows += [Row(**r) for r in json.loads(out.read_text())]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES))
    parser.add_argument("--zoo", nargs="*", default=[])
    parser.add_argument("--json", default=None)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--device", default="cuda")
    for knob in ("warmup", "rounds", "per"):
        parser.add_argument(f"--{knob}", type=int, default=None)
    parser.add_argument(
        "--one-process", action="store_true", help="every size in this process (see run_isolated)"
    )
    args = parser.parse_args()
    from ...verify.determinism import enable_determinism

    timing = {k: getattr(args, k) for k in ("warmup", "rounds", "per") if getattr(args, k)}
    if args.one_process or len(args.accumulate) * (len(args.sizes) + len(args.zoo)) <= 1:
        if args.device == "cuda":
            enable_determinism()
        rows = run(
            tuple(args.accumulate),
            {k: SIZES[k] for k in args.sizes},
            tuple(args.zoo),
            arms=tuple(args.arms),
            device=args.device,
            **timing,
        )
    else:
        rows = run_isolated(
            tuple(args.accumulate),
            tuple(args.sizes),
            tuple(args.zoo),
            tuple(args.arms),
            args.device,
            **timing,
        )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
