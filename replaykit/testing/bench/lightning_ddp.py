"""Lightning DDP step time: native DDP, network replay and the replayed automatic step, per size.

    python -m replaykit.testing.bench.lightning_ddp [--sizes launch-bound,medium] [--steps 60]
        [--device cuda [--one-device]] [--devices 2] [--timeout 90] [--json out.json]

One torchrun job of ``--devices`` processes runs every arm at every size, one after another,
with ``Trainer(strategy="ddp")``; each rank trains its own batches from the same initial weights
(:class:`~replaykit.testing.bench.lightning_step.AutoModule` over ``DetectionNet``) and times its
steps with synchronized stamps; the steady steps' median counts. Rank 0's median is the row's;
every rank's is kept. ``--one-device`` puts every rank on ``cuda:0`` over gloo (the stand-in for
a host with one GPU: the ranks share the GPU, so times are contended); ``--device cpu`` is a
smoke run (gloo, the emulated backend). Not a test: timings are never asserted.

Where the time goes: the callback records ``net``, the module inside DDP's wrapper, so DDP's
forward (its buffer broadcast), the reducer's bucketing and its all-reduce collectives stay
outside every graph and run eagerly, as in native DDP; a replayed backward hands gradients to
the parameters' AccumulateGrad nodes, whose hooks launch the collectives. What replay can save
is the forward, the backward's kernels and (with ``optimizer_step=True``) the optimizer step's
launches, not the communication. To show that share, each size also times the collective alone:
one ``all_reduce`` of a flat buffer the size of every gradient (the reducer's buckets together:
these nets fit one 25 MiB bucket) on the same process group (``allreduce_ms``). A replay arm's
step time minus ``allreduce_ms`` bounds what is left for graphs and Lightning's loop; comparing
with the single-process bench (:mod:`replaykit.testing.bench.lightning_step`) shows what DDP adds.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ...lightning import ReplayCallback
from ..nets import DetectionNet
from ..parity.one_device import one_device_option, one_device_trainer_args
from ..torchrun import stop_jobs_on_sigterm, torchrun, worker_parser
from .lightning_step import AutoModule, fit_step_ms
from .timing import SIZES

NATIVE = "ddp native"
NETWORK = "ddp + network replay"
STEP = "ddp + replayed automatic step"
ARMS = (NATIVE, NETWORK, STEP)


def _layout(devices: int, one_device: bool) -> dict[str, Any]:
    """Trainer arguments: DDP over ``devices`` ranks (every rank on one device when asked)."""
    if one_device:
        return one_device_trainer_args(devices)
    return {"strategy": "ddp", "devices": devices}


def _allreduce_ms(numel: int, device: torch.device, repeats: int = 50) -> float:
    """Median ms of one all-reduce of ``numel`` float32s on the default process group (synchronized)."""
    import torch.distributed as dist

    buf = torch.zeros(numel, device=device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[len(times) // 5 :])


def _rank_rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's rows: every size, every arm, then the collective alone."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    device = spec["device"]
    # where Lightning puts this rank's module: its own GPU, the first under --one-device
    local = 0 if spec["one_device"] else int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(f"cuda:{local}" if device == "cuda" else "cpu")
    rows = []
    for size in [s for s in SIZES if s.name in spec["sizes"]]:
        torch.manual_seed(0)
        base = DetectionNet(width=size.width, depth=size.depth)
        g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
        data = torch.randn(spec["steps"], size.batch, 3, size.image, size.image, generator=g)
        data = data.to(dev)  # preloaded where the step runs: no copy inside the timed steps
        for arm in spec["arms"]:
            net = DetectionNet(width=size.width, depth=size.depth)
            net.load_state_dict(base.state_dict())
            cbs: list[Any] = []
            cb = None
            if arm != NATIVE:
                cb = ReplayCallback("net", optimizer_step=arm == STEP)
                cbs.append(cb)
            module = AutoModule(net)
            layout = _layout(spec["devices"], spec["one_device"])  # a strategy serves one Trainer
            t = fit_step_ms(module, data, device, cbs, use_distributed_sampler=False, **layout)
            row = {
                "size": size.name,
                "arm": arm,
                "median_ms": statistics.median(t),
                "steps": len(t),
            }
            if cb is not None:
                summary = cb.summary()
                row["net_replays"] = summary["net"]["replay"]
                row["net_eager_reasons"] = summary["net"].get("eager_reasons", {})
                if arm == STEP:
                    row["step_replays"] = summary["optimizer_step"]["replay"]
                    row["step_eager_reasons"] = summary["optimizer_step"].get("eager_reasons", {})
                    row["step_retired"] = summary["optimizer_step"].get("retired")
            rows.append(row)
        numel = sum(p.numel() for p in base.parameters())
        ms = float("nan")
        if dist.is_available() and dist.is_initialized():
            ms = _allreduce_ms(numel, dev)
        rows.append({"size": size.name, "arm": "allreduce", "median_ms": ms, "numel": numel})
    return rows


def _worker(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import logging

        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.ERROR)
        if (
            spec["device"] == "cuda"
        ):  # eager must repeat itself, or each recording's check refuses it
            from ...verify.determinism import enable_determinism

            enable_determinism()
        rows = _rank_rows(spec)
    spec_path.with_name(f"rank{rank}.json").write_text(json.dumps(rows, default=str))
    import torch.distributed as dist

    if dist.is_initialized():  # left to interpreter exit, gloo's threads abort the process
        dist.barrier()
        dist.destroy_process_group()


def run(
    sizes: list[str],
    device: str = "cpu",
    steps: int = 60,
    devices: int = 2,
    one_device: bool = False,
    arms: tuple[str, ...] = ARMS,
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Every arm at every size in one torchrun job; one dict per size: rank 0's median per arm,
    every rank's, replay counts per rank, and the all-reduce alone."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {ARMS}")
    spec = {
        "sizes": sizes,
        "device": device,
        "steps": steps,
        "devices": devices,
        "one_device": one_device,
        "arms": list(arms),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        torchrun(
            "replaykit.testing.bench.lightning_ddp",
            ["--worker", str(path)],
            devices,
            timeout,
            f"the DDP bench x{devices}",
        )
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(devices)]
    out = []
    for size in [s for s in sizes if any(r["size"] == s for r in ranks[0])]:
        per_rank = [{r["arm"]: r for r in rows if r["size"] == size} for rows in ranks]
        result: dict[str, Any] = {"size": size, "device": device, "devices": devices}
        result["transport"] = _transport(device, one_device)
        for arm in (*arms, "allreduce"):
            result[arm] = {
                "median_ms": per_rank[0][arm]["median_ms"],
                "per_rank_ms": [p[arm]["median_ms"] for p in per_rank],
                **{
                    k: [p[arm].get(k) for p in per_rank]
                    for k in (
                        "net_replays",
                        "net_eager_reasons",
                        "step_replays",
                        "step_eager_reasons",
                        "step_retired",
                    )
                    if k in per_rank[0][arm]
                },
            }
        result["allreduce"]["numel"] = per_rank[0]["allreduce"]["numel"]
        result["line"] = line(result, arms)
        out.append(result)
    return out


def _transport(device: str, one_device: bool) -> str:
    if one_device:
        return f"every rank on {'cuda:0' if device == 'cuda' else 'the CPU'} over gloo"
    return "nccl" if device == "cuda" else "gloo"


def line(result: dict[str, Any], arms: tuple[str, ...] = ARMS) -> str:
    """One size: rank 0's median per arm, the replay counts, the collective alone."""
    parts = []
    for arm in arms:
        r = result[arm]
        text = f"{arm} {r['median_ms']:.3f} ms"
        counts = [f"{k.split('_')[0]} {r[k]}" for k in ("net_replays", "step_replays") if k in r]
        if counts:
            text += f" (replays per rank: {', '.join(counts)})"
        parts.append(text)
    ar = result["allreduce"]
    return (
        f"lightning ddp {result['size']} x{result['devices']} ({result['transport']}): "
        + ", ".join(parts)
        + f"; all-reduce of every gradient alone {ar['median_ms']:.3f} ms ({ar['numel']} floats)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = worker_parser(__doc__)
    ap.add_argument("--sizes", default="launch-bound,medium")
    ap.add_argument("--steps", type=int, default=60, help="batches per rank and arm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--devices", type=int, default=2, help="DDP ranks (processes)")
    one_device_option(ap)
    ap.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated, from: " + ", ".join(ARMS)
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the job is stopped")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    stop_jobs_on_sigterm()
    try:
        results = run(
            args.sizes.split(","),
            args.device,
            args.steps,
            args.devices,
            args.one_device,
            tuple(args.arms.split(",")),
            args.timeout,
        )
    except RuntimeError as exc:
        print(f"lightning ddp bench: {exc}", flush=True)
        return 1
    for r in results:
        print(r["line"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
