"""``rk.TrainStep`` over ``DistributedDataParallel``: every rank against the same DDP step run eagerly.

    python -m replaykit.testing.parity.ddp_step [--device cuda] [--precision bf16-mixed] [--accumulate 2]

The driver starts ``world`` processes (gloo; on a GPU host every rank uses ``cuda:0``: the
one-GPU stand-in for two GPUs). Each rank runs the arms one after another from one seed, on its
own shard of the batches:

- ``native``: eager DDP written out (``no_sync`` on accumulation micro-batches, autocast,
  ``loss / accumulate``, scaler, clip, SGD, ``zero_grad(set_to_none=True)``);
- ``trainstep``: ``rk.TrainStep(ddp, ...)``: the two-graph form (forward+backward replayed, DDP's
  all-reduce between, clip+optimizer replayed), the ranks agreeing on each call's route;
- ``unsafe``: the same with the ``unsafe`` protection switched off (``rank_agreement``);
- with ``loss_closure``, the loss calls the DDP wrapper it closes over, not the model it is given;
  with ``loss_collective``, it divides by the batch size all-reduced across the ranks;
- with ``rank1_change``, rank 1 alone changes a value the forward reads (dropout's ``p``) for
  one call, so rank 1 alone meets a re-record trigger there; with ``rank1_stall`` rank 1 sleeps
  before one call (the watchdog's case, with ``replay_timeout``).

Each arm's end state (weights, buffers, momentum, losses) is compared with native's bit for bit
on every rank, and the ranks' weights with each other; each call's route is kept per rank.
Every process runs under a deadline: a hung collective ends the run with a message.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..torchrun import worker_parser
from .plain_ddp import run_ranks
from .trial import scaled_step

ROUTES = ("replay", "record", "eager")


@dataclass(frozen=True)
class Case:
    """One run of every arm on every rank."""

    precision: str = "32"
    accumulate: int = 1
    device: str = "cpu"
    steps: int = 4  # optimizer steps
    world: int = 2
    arms: tuple[str, ...] = ("native", "trainstep")
    rank1_change: int = 0  # the call at which rank 1 alone changes dropout.p (0: never)
    rank1_stall: int = 0  # the call before which rank 1 alone sleeps 3 s (0: never)
    find_unused: bool = False  # DDP(find_unused_parameters=...): a configuration the step refuses
    default_stream: bool = False  # on CUDA, DDP built on the default stream: the step refuses it
    loss_closure: bool = False  # the loss calls the DDP wrapper from its closure
    loss_collective: bool = False  # the loss is normalised by a count all-reduced across ranks
    unsafe: str = "rank_agreement"  # the protection the unsafe arm switches off
    replay_timeout: float | None = None
    width: int = 32
    depth: int = 2
    batch: int = 8
    bench: int = 0  # > 0: time this many steps per arm instead of the parity run (ms per step)


def _net(case: Case) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, case.width), nn.BatchNorm1d(case.width), nn.ReLU()]
    for _ in range(case.depth - 1):
        layers += [nn.Linear(case.width, case.width), nn.ReLU()]
    layers += [nn.Dropout(0.1), nn.Linear(case.width, 4)]
    return nn.Sequential(*layers)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _global_mean(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss summed, over the number of items all ranks hold (an all-reduce inside the loss)."""
    import torch.distributed as dist

    count = torch.tensor(float(y.numel()), device=y.device)
    dist.all_reduce(count)
    return nn.functional.cross_entropy(model(x), y, reduction="sum") / count


def _setup(case: Case) -> tuple:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = _net(case).to(case.device)
    # on CUDA, built on a side stream, as torch's CUDA graphs notes ask of DDP (Lightning does)
    side = (
        torch.cuda.Stream() if case.device.startswith("cuda") and not case.default_stream else None
    )
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        ddp = DDP(net, find_unused_parameters=case.find_unused)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    # a GradScaler steps a fused optimizer without reading found_inf on the host
    fused = case.precision == "16-mixed" or None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler(case.device) if case.precision == "16-mixed" else None
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    n = case.steps * case.accumulate
    batches = [
        (
            torch.randn(case.batch, 8, generator=g).to(case.device),
            torch.randint(0, 4, (case.batch,), generator=g).to(case.device),
        )
        for _ in range(n)
    ]
    torch.manual_seed(1 + rank)
    return net, ddp, opt, scaler, batches


def _native_step(case: Case, ddp: nn.Module, opt: Any, scaler: Any, i: int, x: Any, y: Any) -> Any:
    from replaykit.step_config import PRECISIONS

    acc = case.accumulate
    sync = (i + 1) % acc == 0
    dtype = PRECISIONS[case.precision]
    ac = torch.autocast(case.device, dtype=dtype) if dtype else contextlib.nullcontext()
    with ddp.no_sync() if not sync else contextlib.nullcontext():
        with ac:
            loss = (_global_mean if case.loss_collective else loss_fn)(ddp, x, y)
        scaled = loss / acc if acc > 1 else loss
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
    if sync:
        if scaler is not None:
            scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, foreach=True, error_if_nonfinite=False)
        scaled_step(opt, scaler)
    return loss.detach()


def routes(step: Any) -> list[str]:
    """Each call's route, in order (from the journal)."""
    by_call: dict[int, str] = {}
    for e in step.journal:
        if e.kind in ROUTES and e.call not in by_call:
            by_call[e.call] = e.kind if e.kind != "eager" else f"eager:{e.reason}"
    return [by_call.get(c, "?") for c in range(1, max(by_call, default=0) + 1)]


def _trainer(case: Case, arm: str, ddp: Any, opt: Any, scaler: Any) -> tuple[Any, Any]:
    """``(run, step)``: ``run(i, x, y)`` trains call ``i`` of ``arm``; ``step``: its entry point
    (a TrainStep, or the network replay's (recorder, OptimizerStep)), None for native."""
    import replaykit as rk
    from replaykit.optimizer_step import OptimizerStep

    if arm == "native":
        return (lambda i, x, y: _native_step(case, ddp, opt, scaler, i, x, y)), None
    if arm == "capture+step":  # network replay: DDP's forward and reducer outside the graphs
        rec, ostep = rk.capture(ddp.module), OptimizerStep(opt)

        def clip_and_step() -> None:
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, foreach=True, error_if_nonfinite=False)
            opt.step()

        def run(i: int, x: Any, y: Any) -> Any:
            loss = loss_fn(ddp, x, y)
            loss.backward()
            ostep(clip_and_step, ("norm", 1.0))
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return run, (rec, ostep)
    closed = lambda m, x, y: loss_fn(ddp, x, y)  # noqa: E731  (the wrapper, not ``m``)
    chosen = closed if case.loss_closure else _global_mean if case.loss_collective else loss_fn
    step = rk.TrainStep(
        ddp, chosen, opt, scaler=scaler, max_norm=1.0,
        accumulate=case.accumulate,
        precision=case.precision, backend="auto" if case.device != "cpu" else "emulated",
        warmup=2, unsafe_disable=(case.unsafe,) if arm == "unsafe" else (),
        replay_timeout=30.0 if arm == "trainstep+watchdog" else case.replay_timeout,
    )  # fmt: skip
    return (lambda i, x, y: step(x, y)), step


def _arm(case: Case, arm: str) -> dict[str, Any]:
    """One arm on this rank: end state, each call's route, what it replayed."""
    import torch.distributed as dist

    rank = dist.get_rank()
    net, ddp, opt, scaler, batches = _setup(case)
    run, step = _trainer(case, arm, ddp, opt, scaler)
    info: dict[str, Any] = {}
    losses: list[torch.Tensor] = []
    error = None
    try:
        for i, (x, y) in enumerate(batches):
            if case.rank1_change and rank == 1:
                net[-2].p = 0.2 if i + 1 == case.rank1_change else 0.1
            if case.rank1_stall == i + 1 and rank == 1:
                time.sleep(3.0)  # a stuck rank, as the watchdog sees it
            losses.append(run(i, x, y))
    except Exception as exc:  # the unsafe arm's unpaired collective: kept, compared by the driver
        error = f"{type(exc).__name__}: {exc}"
    if isinstance(step, tuple):
        rec, ostep = step
        info = {"replay": min(rec.counts["replay"], ostep.counts["replay"])}
        info["summary"] = f"{rec.summary()} || {ostep.summary()}"
        rec.release()
    elif step is not None:
        info = {"routes": routes(step), "replay": step.counts["replay"], "summary": step.summary()}
        step.release()
    state = end_state(net, opt, losses)
    return {"state": state, "error": error, **info}


def end_state(net: nn.Module, opt: Any, losses: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an arm is judged by, on the CPU: weights, buffers, momentum, losses."""
    state = {f"param/{n}": p.detach().cpu().clone() for n, p in net.named_parameters()}
    state.update({f"buffer/{n}": b.cpu().clone() for n, b in net.named_buffers()})
    state.update(
        {f"momentum/{i}": s["momentum_buffer"].cpu() for i, s in enumerate(opt.state.values())}
    )
    state.update({f"loss/{i}": v.float().cpu() for i, v in enumerate(losses)})
    return state


def _bench(case: Case, arm: str) -> dict[str, Any]:
    """ms per optimizer step of ``arm`` on this rank, and what it replayed (``allreduce``: one
    all-reduce of the gradients' size alone, the floor; ``agree``: the route agreement alone)."""
    import torch.distributed as dist

    from replaykit.distributed.ranks import RankAgreement

    net, ddp, opt, scaler, batches = _setup(case)
    x, y = batches[0]
    step: Any = None
    if arm == "allreduce":
        flat = torch.zeros(sum(p.numel() for p in net.parameters()), device=case.device)
        run = lambda i, x, y: dist.all_reduce(flat)  # noqa: E731
    elif arm == "agree":
        agreement = RankAgreement(None, None)
        run = lambda i, x, y: agreement.agree("replay")  # noqa: E731
    else:
        run, step = _trainer(case, arm, ddp, opt, scaler)
    out: dict[str, Any] = {}
    per_step = 1 if arm in ("allreduce", "agree") else case.accumulate
    for i in range(6 * per_step):
        run(i, x, y)
    _sync(case.device)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(case.bench * per_step):
        run(i, x, y)
    _sync(case.device)
    out["ms"] = (time.perf_counter() - t0) * 1e3 / case.bench
    if isinstance(step, tuple):
        out["replay"] = min(step[0].counts["replay"], step[1].counts["replay"])
        step[0].release()
    elif step is not None:
        out["replay"], out["summary"] = step.counts["replay"], step.summary()
        step.release()
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rank_worker(spec: Path, run_case: Callable[[dict], dict]) -> None:
    """One rank of a launch: the gloo group (Lightning finds it initialised and keeps it),
    ``run_case`` over each case of ``spec`` (a dict each), this rank's results saved beside it."""
    from datetime import timedelta

    import torch.distributed as dist

    data = json.loads(spec.read_text())
    # a collective left unpaired (the unsafe arm) fails after this, not after gloo's 30 minutes
    dist.init_process_group("gloo", timeout=timedelta(seconds=data["pg_timeout"]))
    rank = dist.get_rank()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = [run_case(c) for c in data["cases"]]
        torch.save(results, spec.parent / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def launch_ranks(
    module: str, cases: list[Any], timeout: float, pg_timeout: float, what: str
) -> list[list[dict]]:
    """Every case of ``cases`` (dataclasses with ``world``) on ``world`` ranks of ``python -m
    module --worker``, one after another in the same processes (they start once); each rank's
    results per case. Past ``timeout`` every rank is killed."""
    world = cases[0].world
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps({"cases": [asdict(c) for c in cases], "pg_timeout": pg_timeout}))
        run_ranks(module, ["--worker", str(spec)], world, timeout, what)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _run_case(data: dict) -> dict:
    case = Case(**{**data, "arms": tuple(data["arms"])})
    return {arm: (_bench if case.bench else _arm)(case, arm) for arm in case.arms}


def launch(cases: list[Case], timeout: float = 60, pg_timeout: float = 60) -> list[list[dict]]:
    """Every arm of each case on ``world`` ranks; each rank's results per case."""
    module = "replaykit.testing.parity.ddp_step"
    return launch_ranks(module, cases, timeout, pg_timeout, "DDP TrainStep")


def compare(cases: list[Case], timeout: float = 60, pg_timeout: float = 60) -> list[dict]:
    """Per case: every arm against native on every rank, the ranks' weights against each other."""
    per_rank = launch(cases, timeout, pg_timeout)
    return [_judge(case, [r[i] for r in per_rank]) for i, case in enumerate(cases)]


def judge_arm(ranks: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    """``arm`` against native on every rank (bit for bit), the ranks' weights against each
    other, and what each rank routed, replayed and raised."""
    from ...verify.bitwise import diff_states

    diffs = [[d.name for d in diff_states(r["native"]["state"], r[arm]["state"])] for r in ranks]
    weights = [{k: v for k, v in r[arm]["state"].items() if k.startswith("param/")} for r in ranks]
    return {
        "equal": all(not d for d in diffs) and not any(r[arm]["error"] for r in ranks),
        "ranks_agree": all(not diff_states(weights[0], w) for w in weights[1:]),
        "diffs": diffs,
        "routes": [r[arm].get("routes") for r in ranks],
        "replay": [r[arm].get("replay") for r in ranks],
        "errors": [r[arm]["error"] for r in ranks],
        "summaries": [r[arm].get("summary") for r in ranks],
    }


def _judge(case: Case, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"case": asdict(case)}
    for arm in case.arms[1:]:
        out[arm] = {**judge_arm(ranks, arm), "ms": [r[arm].get("ms") for r in ranks]}
    out["native_ms"] = [r["native"].get("ms") for r in ranks]
    return out


def harness_main(
    argv: list[str] | None,
    doc: str | None,
    run_case: Callable[[dict], dict],
    one_case: Callable[[str, int, str, float], dict],
    arm: str,
    timeout: float,
) -> int:
    """A DDP harness's command line: a rank (``--worker``), or one case on every rank, its ``arm``
    printed; exit 0 when that arm equals native on every rank and the ranks agree."""
    ap = worker_parser(doc)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="32")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=timeout)
    args = ap.parse_args(argv)
    if args.worker:
        rank_worker(args.worker, run_case)
        return 0
    result = one_case(args.precision, args.accumulate, args.device, args.timeout)
    print(json.dumps(result[arm], default=str)[:4000])
    return 0 if result[arm]["equal"] and result[arm]["ranks_agree"] else 1


def main(argv: list[str] | None = None) -> int:
    def one(precision: str, accumulate: int, device: str, timeout: float) -> dict:
        return compare([Case(precision, accumulate, device)], timeout)[0]

    return harness_main(argv, __doc__, _run_case, one, "trainstep", 60)


if __name__ == "__main__":
    raise SystemExit(main())
