"""Hostile DDP parity harness: each scenario is user code run on 2 gloo ranks in three modes.

    python scripts/hostile/ddp/harness.py [scenario ...] [--timeout 90]

Modes (one launch of 2 processes runs all three; ``--split``: each its own launch, so a
failed mode cannot desync the next):
- ``plain``: the user's loop with a hand-written eager DDP step (no replaykit at all);
- ``twin``: ``rk.TrainStep(..., replay=False)``;
- ``replay``: ``rk.TrainStep(..., backend="emulated", replay_timeout=20)``.

Every rank's end state (params, grads' None pattern and bits, buffers, optimizer state, lr,
losses, EMA, scenario extras) is compared bit for bit: twin vs plain and replay vs plain.
Outcome per scenario: BITWISE (replays>0), EAGER(reason), ERROR(...), SILENT DIFF, HANG.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = ("plain", "twin", "replay")


class PlainStep:
    """What a user writes by hand: eager DDP, no_sync on accumulation micro-batches."""

    def __init__(self, ddp, loss_fn, opt, *, scaler=None, max_norm=None, accumulate=1,
                 precision="32", ema=None) -> None:  # fmt: skip
        self.ddp, self.loss_fn, self.opt = ddp, loss_fn, opt
        self.scaler, self.max_norm, self.acc = scaler, max_norm, accumulate
        self.dtype = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}[
            precision
        ]
        self.ema, self.micro = ema, 0
        self.counts = {"plain": 0}

    def __call__(self, *args, **kwargs):
        self.micro = self.micro % self.acc + 1
        sync = self.micro == self.acc
        ddp = self.ddp
        quiet = ddp.no_sync() if not sync else contextlib.nullcontext()
        ac = torch.autocast("cpu", dtype=self.dtype) if self.dtype else contextlib.nullcontext()
        with quiet:
            with ac:
                loss = self.loss_fn(ddp, *args, **kwargs)
            scaled = loss / self.acc if self.acc > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        if sync:
            if self.max_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.opt)
                # the order the twin clips in: the model's parameters, then the optimizer's
                ps = list(ddp.parameters()) + [
                    p for g in self.opt.param_groups for p in g["params"]
                ]
                ps = [p for p in dict.fromkeys(ps) if p.requires_grad and p.grad is not None]
                nn.utils.clip_grad_norm_(ps, self.max_norm, foreach=True, error_if_nonfinite=False)
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
            if self.ema is not None:
                self.ema.update()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class Ctx:
    """Handed to a scenario: which mode, the rank, and ``make_step`` for the mode's step."""

    def __init__(self, mode: str, rank: int) -> None:
        self.mode, self.rank = mode, rank
        self.steps: list[Any] = []
        self.extras: dict[str, Any] = {}

    def make_step(self, ddp, loss_fn, opt, **kw):
        if self.mode == "plain":
            step = PlainStep(ddp, loss_fn, opt, **kw)
        else:
            import replaykit as rk

            replay = self.mode == "replay"
            extra = {"backend": "emulated", "replay_timeout": 20.0} if replay else {}
            step = rk.TrainStep(ddp, loss_fn, opt, replay=replay, **kw, **extra)
        self.steps.append(step)
        return step

    def keep(self, name: str, value: Any) -> None:
        self.extras[name] = value


def data(rank: int, n: int, batch: int = 8, feat: int = 8, classes: int = 4, seed: int = 100):
    g = torch.Generator().manual_seed(seed + rank)
    return [
        (torch.randn(batch, feat, generator=g), torch.randint(0, classes, (batch,), generator=g))
        for _ in range(n)
    ]


def ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def net_bn() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4)
    )


def _flat(prefix: str, obj: Any, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}/{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flat(f"{prefix}/{i}", v, out)
    elif isinstance(obj, (int, float, bool)) or obj is None:
        out[prefix] = obj


def end_state(model: nn.Module, opt: Any, losses: list, extras: dict) -> dict:
    s: dict[str, Any] = {}
    for n, p in model.named_parameters():
        s[f"param/{n}"] = p.detach().clone()
        s[f"grad/{n}"] = None if p.grad is None else p.grad.detach().clone()
    for n, b in model.named_buffers():
        s[f"buffer/{n}"] = b.detach().clone()
    if opt is not None:
        sd = opt.state_dict()
        _flat("opt/state", sd["state"], s)
        for i, g in enumerate(sd["param_groups"]):
            for k in ("lr", "momentum", "weight_decay", "betas"):
                if k in g:
                    _flat(f"opt/group{i}/{k}", g[k], s)
    for i, v in enumerate(losses):
        s[f"loss/{i}"] = None if v is None else torch.as_tensor(v).detach().clone().float()
    _flat("extra", extras, s)
    return s


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if torch.equal(a, b):
            return True
        # a NaN loss (a GradScaler's overflow step) equals a NaN at the same place
        nan = a.isnan() if a.is_floating_point() else None
        return nan is not None and torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


def diff(a: dict, b: dict) -> list[str]:
    out = [f"missing:{k}" for k in a.keys() ^ b.keys()]
    out += [k for k in a.keys() & b.keys() if not same(a[k], b[k])]
    return sorted(out)


def step_info(steps: list) -> list[dict]:
    out = []
    for st in steps:
        if not hasattr(st, "journal"):
            continue
        from collections import Counter

        reasons = Counter()
        for e in st.journal:
            if e.kind in ("eager", "refuse", "retire"):
                reasons[f"{e.kind}:{str(e.reason)[:90]}"] += 1
        out.append(
            {
                "counts": dict(st.counts),
                "reasons": dict(reasons),
                "summary": st.summary()[:600],
            }
        )
    return out


# ------------------------------------------------------------------ worker / launcher
def worker(name: str, modes: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        for mode in modes.split(","):
            run_mode(name, mode, out)
            dist.monitored_barrier(timeout=timedelta(seconds=40))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_mode(name: str, mode: str, out: Path) -> None:
    import scenarios

    rank = dist.get_rank()
    ctx = Ctx(mode, rank)
    fn = getattr(scenarios, name)
    result: dict[str, Any] = {"error": None}
    caught: list[str] = []
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            model, opt, losses = fn(ctx)
            result["state"] = end_state(model, opt, losses, ctx.extras)
        except Exception as exc:  # kept: the driver classifies it
            result["error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:700]
            result["tb"] = traceback.format_exc()[-2500:]
        caught = [
            f"{x.category.__name__}: {str(x.message)[:200]}"
            for x in w
            if "Replay" in x.category.__name__
        ]
    result["warnings"] = sorted(set(caught))
    result["steps"] = step_info(ctx.steps)
    torch.save(result, out / f"{name}.{mode}.rank{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, mode: str, out: Path, timeout: float) -> str | None:
    port = free_port()
    procs = []
    world = int(os.environ.get("HK_WORLD", "2"))  # HK_WORLD=3: three ranks
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", name, mode, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    problem = None
    for rank, p in enumerate(procs):
        try:
            so, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                problem = f"rank {rank} exit {p.returncode}: {so[-1500:]}"
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            return f"HANG (> {timeout:.0f} s)"
    return problem


def judge(name: str, out: Path, timeout: float, split: bool) -> dict:
    res: dict[str, Any] = {"name": name}
    per: dict[str, list] = {}
    groups = [[m] for m in MODES] if split else [list(MODES)]
    for group in groups:
        prob = launch(name, ",".join(group), out, timeout)
        if prob is not None:
            res[f"{group[0]}_launch"] = prob
    for mode in MODES:
        per[mode] = []
        for r in range(int(os.environ.get("HK_WORLD", "2"))):
            f = out / f"{name}.{mode}.rank{r}.pt"
            per[mode].append(torch.load(f, weights_only=False) if f.exists() else None)
    res["per"] = per
    return res


def verdict(res: dict) -> list[str]:
    per = res["per"]
    lines = [f"=== {res['name']}"]
    for mode in MODES:
        if f"{mode}_launch" in res:
            lines.append(f"  {mode}: LAUNCH PROBLEM {res[f'{mode}_launch'][:600]}")
    for mode in MODES:
        for r, rr in enumerate(per[mode]):
            if rr is None:
                lines.append(f"  {mode} rank{r}: no result")
                continue
            if rr["error"]:
                lines.append(f"  {mode} rank{r}: ERROR {rr['error'][:400]}")
            for st in rr["steps"]:
                if mode != "plain":
                    lines.append(f"  {mode} rank{r}: counts={st['counts']} reasons={st['reasons']}")
            if rr["warnings"]:
                lines.append(f"  {mode} rank{r}: warnings={rr['warnings'][:3]}")
    for mode in ("twin", "replay"):
        for r in range(len(per["plain"])):
            a, b = per["plain"][r], per[mode][r]
            if a is None or b is None or "state" not in a or "state" not in b:
                continue
            d = diff(a["state"], b["state"])
            tag = "BITWISE" if not d else f"DIFF {len(d)}: {d[:8]}"
            lines.append(f"  {mode} vs plain rank{r}: {tag}")
    return lines


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2], Path(argv[3]))
        return 0
    import scenarios

    timeout = 240.0
    if "--timeout" in argv:
        i = argv.index("--timeout")
        timeout = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    split = "--split" in argv
    argv = [a for a in argv if a != "--split"]
    names = argv or scenarios.ALL
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.monotonic()
            res = judge(name, Path(tmp), timeout, split)
            print("\n".join(verdict(res)), f"  [{time.monotonic() - t0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
