"""Replay under plain ``torch.distributed`` DDP (no Lightning): a hand-written launch, every rank compared.

    python -m replaykit.testing.parity.plain_ddp [--device cuda] [--world 2] [--timeout 60]

The driver starts ``world`` processes itself (gloo; on a GPU host every rank uses ``cuda:0``,
the one-GPU stand-in for two). Each rank trains the same small model wrapped in
``DistributedDataParallel`` three ways from one seed, on its own shard of the batches:

- ``native``: eager DDP (forward, backward with DDP's all-reduce, clip, SGD step);
- ``trainstep``: ``rk.TrainStep(ddp, ...)``: the two-graph form (forward+backward and the
  optimizer step replayed, DDP's all-reduce between them: :mod:`replaykit.distributed.reduction`);
- ``capture+step``: ``rk.capture(ddp.module)`` (network replay: DDP's forward, reducer and
  collectives stay outside the graphs) and :class:`~replaykit.optimizer_step.OptimizerStep`.

Every arm's end state (weights, gradients, momentum, losses) must equal native's bit for bit on
every rank, and the ranks' weights must agree. Every process runs under a deadline: a hung
collective ends the run with a message instead of a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..torchrun import worker_parser

ARMS = ("native", "trainstep", "capture+step")


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4)
    )


def _arm(arm: str, device: str, steps: int) -> dict[str, Any]:
    """One arm on this rank: its end state and what replayed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import replaykit as rk
    from replaykit.optimizer_step import OptimizerStep

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = _net().to(device)
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    batches = [
        (
            torch.randn(6, 8, generator=g).to(device),
            torch.randint(0, 4, (6,), generator=g).to(device),
        )
        for _ in range(steps)
    ]

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    def clip_and_step() -> None:
        nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        opt.step()

    info: dict[str, Any] = {}
    losses = []
    torch.manual_seed(1 + rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if arm == "trainstep":
            step = rk.TrainStep(ddp, loss_fn, opt, max_norm=0.5)
            losses = [step(x, y) for x, y in batches]
            info = {"summary": step.summary(), "replay": step.counts["replay"]}
        else:
            rec = rk.capture(ddp.module) if arm == "capture+step" else None
            ostep = OptimizerStep(opt) if arm == "capture+step" else None
            for x, y in batches:
                opt.zero_grad()
                loss = loss_fn(ddp, x, y)
                loss.backward()
                if ostep is None:
                    clip_and_step()
                else:
                    ostep(clip_and_step, ("norm", 0.5))
                losses.append(loss.detach())
            if rec is not None and ostep is not None:
                info = {
                    "summary": f"{rec.summary()} || {ostep.summary()}",
                    "replay": min(rec.counts["replay"], ostep.counts["replay"]),
                }
                rec.release()
    state = {f"param/{n}": p.detach().cpu().clone() for n, p in net.named_parameters()}
    state.update(
        {f"grad/{n}": None if p.grad is None else p.grad.cpu() for n, p in net.named_parameters()}
    )
    state.update({f"buffer/{n}": b.cpu().clone() for n, b in net.named_buffers()})
    state.update(
        {f"momentum/{i}": s["momentum_buffer"].cpu() for i, s in enumerate(opt.state.values())}
    )
    state.update({f"loss/{i}": v.cpu() for i, v in enumerate(losses)})
    return {"state": state, **info}


def _worker(out: Path, device: str, steps: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        results = {arm: _arm(arm, device, steps) for arm in ARMS}
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on this host for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, args: list[str], world: int, timeout: float, what: str) -> None:
    """``world`` ranks of ``python -m module *args``, their rendezvous on a free local port; waits for
    all. Past ``timeout`` seconds every rank is killed; raises naming ``what`` when one fails."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    failures = []
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            raise RuntimeError(
                f"{what} rank {rank} did not finish in {timeout:.0f} s (a hung collective?); "
                "every rank was killed"
            ) from None
        if proc.returncode != 0:
            failures.append(f"rank {rank} exit {proc.returncode}: {err[-3000:]}")
    if failures:
        raise RuntimeError(f"{what} run failed:\n" + "\n".join(failures))


def compare(
    world: int = 2, device: str = "cpu", steps: int = 6, timeout: float = 60
) -> dict[str, Any]:
    """Launch ``world`` ranks, then every arm against native on every rank and the ranks against each other."""
    from ...verify.bitwise import diff_states

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        args = ["--worker", str(out), "--device", device, "--steps", str(steps)]
        run_ranks("replaykit.testing.parity.plain_ddp", args, world, timeout, "plain DDP")
        ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]

    def names(arm: str, rank: dict[str, Any]) -> list[str]:
        native, mine = rank["native"]["state"], rank[arm]["state"]
        if arm == "trainstep":  # a TrainStep's step ends with zero_grad(set_to_none=True)
            native = {k: v for k, v in native.items() if not k.startswith("grad/")}
            assert all(v is None for k, v in mine.items() if k.startswith("grad/"))
            mine = {k: v for k, v in mine.items() if not k.startswith("grad/")}
        return [d.name for d in diff_states(native, mine)]

    diffs = {arm: [names(arm, r) for r in ranks] for arm in ARMS[1:]}
    weights = [
        {k: v for k, v in r["capture+step"]["state"].items() if k.startswith("param/")}
        for r in ranks
    ]
    agree = all(not diff_states(weights[0], w) for w in weights[1:])
    return {
        "equal": all(not d for per_rank in diffs.values() for d in per_rank),
        "ranks_agree": agree,
        "diffs": diffs,
        "replays": {arm: [r[arm].get("replay") for r in ranks] for arm in ARMS[1:]},
        "summaries": {arm: [r[arm].get("summary") for r in ranks] for arm in ARMS[1:]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = worker_parser(__doc__)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on cuda:0)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=60, help="seconds before every rank is killed")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.device, args.steps)
        return 0
    result = compare(args.world, args.device, args.steps, args.timeout)
    ok = result["equal"] and result["ranks_agree"] and min(result["replays"]["capture+step"]) > 0
    print(
        f"plain DDP x{args.world} on {args.device} (gloo): ok={ok}; every arm equal to native on every "
        f"rank: {result['equal']}; ranks agree: {result['ranks_agree']}"
    )
    print(json.dumps({k: result[k] for k in ("diffs", "replays", "summaries")}, default=str)[:4000])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
