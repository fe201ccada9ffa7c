"""Parity under Lightning DDP: each arm runs as ``devices`` processes under torchrun, every rank compared.

    python -m replaykit.testing.parity.ddp --task detection --accumulation 2 --devices 2 [--device cuda]
    python -m replaykit.testing.parity.ddp --matrix --jobs 3 --json m.json --md m.md  # 9 scenarios

``--matrix`` runs :mod:`replaykit.testing.parity.ddp_matrix`'s scenarios (precision x
accumulation, the replay and step arms), ``--jobs`` torchrun jobs at a time.

The driver launches one torchrun job per arm (``native``, ``replay``); each rank trains the
same scenario with ``Trainer(strategy="ddp")`` and saves its end state. Every rank's replay
state must equal the same rank's native state bit for bit, and (DDP's promise) all ranks
must hold the same weights. On CPUs the process group is gloo and replay uses the
emulated backend; on GPUs it is NCCL and CUDA graphs.

How replay meets DDP: the callback records ``net`` (the module inside DDP's wrapper), so
DDP's forward, its reducer and its collectives stay outside every graph. A replayed
backward hands its gradients to the parameters' AccumulateGrad nodes like eager does, so
DDP's hooks bucket and all-reduce them exactly as in native training, ``no_sync``
accumulation included; warm-up and capture differentiate stand-ins for the parameters and
never reach those hooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from ...verify.bitwise import TensorDiff, diff_states
from ..torchrun import stop_jobs_on_sigterm, torchrun, worker_parser
from .arms import STEP_ARM, STEP_UNSAFE, run_arm
from .ddp_matrix import UNSAFE_ARM, arm_report, ddp_scenarios, line, markdown, passed, total
from .one_device import one_device_option
from .scenario import ArmOutcome, Scenario, ScenarioResult, quiet_replay_warnings


def launch(
    scenario: Scenario, arm: str | tuple[str, ...], out_dir: Path, timeout: float = 600
) -> Any:
    """Run one arm (or several, one after another in the same processes) as ``scenario.devices``
    processes; returns each rank's saved outcome (per arm, for several). A job that outlives
    ``timeout`` (a hung collective) is stopped, every worker with it, and raises saying so."""
    arms = (arm,) if isinstance(arm, str) else tuple(arm)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / f"{'+'.join(a.replace(':', '_') for a in arms)}.json"
    spec.write_text(json.dumps({"scenario": dataclasses.asdict(scenario), "arms": arms}))
    torchrun(
        "replaykit.testing.parity.ddp",
        ["--worker", str(spec)],
        scenario.devices,
        timeout,
        f"{'+'.join(arms)} arm(s) of {scenario.name} x{scenario.devices}",
    )
    saved = {
        a: [
            torch.load(out_dir / f"{spec.stem}.{_file(a)}.rank{r}.pt", weights_only=False)
            for r in range(scenario.devices)
        ]
        for a in arms
    }
    return saved[arms[0]] if isinstance(arm, str) else saved


def _file(arm: str) -> str:
    return arm.replace(":", "_")


def compare(
    scenario: Scenario, arms: tuple[str, ...] = ("native", "replay"), timeout: float = 600
) -> dict[str, Any]:
    """Every arm against native, rank by rank, and the ranks' weights against each other (every
    arm runs in one job: the processes start once)."""
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = launch(scenario, tuple(arms), Path(tmp), timeout)
    native = outcomes["native"]
    diffs: dict[str, list[list[TensorDiff]]] = {
        arm: [diff_states(n["state"], o["state"]) for n, o in zip(native, ranks, strict=True)]
        for arm, ranks in outcomes.items()
        if arm != "native"
    }
    replaying = [a for a in outcomes if a in ("replay", "step")]
    agree = all(ranks_agree(outcomes[a]) for a in replaying)
    errors = {arm: [o["error"] for o in ranks] for arm, ranks in outcomes.items()}
    replays = [(o["recorder"] or {}).get("replay", 0) for a in replaying for o in outcomes[a]]
    step_replays = [
        (o["recorder"] or {}).get("optimizer_step", {}).get("replay", 0)
        for o in outcomes.get("step", [])
    ]
    equal = all(not d for ranks in diffs.values() for d in ranks)
    return {
        "scenario": scenario.name,
        "ok": equal
        and agree
        and not any(e for es in errors.values() for e in es)
        and min(replays, default=0) > 0
        and min(step_replays, default=1) > 0,
        "equal": equal,
        "diffs": diffs,
        "ranks_agree": agree,
        "recorders": {arm: [o["recorder"] for o in ranks] for arm, ranks in outcomes.items()},
        "step_replays": step_replays,
        "errors": errors,
        "steps": [int(o["state"]["progress/global_step"]) for o in outcomes["native"]],
    }


def ranks_agree(ranks: list[dict[str, Any]]) -> bool:
    """DDP's promise: every rank ends with the same weights."""
    weights = [{k: v for k, v in o["state"].items() if k.startswith("param/")} for o in ranks]
    return all(not diff_states(weights[0], w) for w in weights[1:])


def run_scenario(
    scenario: Scenario, arms: tuple[str, ...] = ("native", "replay")
) -> ScenarioResult:
    """``compare`` as a :class:`ScenarioResult`: rank 0's outcomes, every rank's diffs (``rank<r>/...``).

    Ranks that disagree with each other add a ``ranks/disagree`` row to the replay arm.
    """
    names = ("native", *[a for a in arms if a != "native"])
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch(scenario, names, Path(tmp))
    native = per_rank["native"]
    outcomes, diffs = {}, {}
    for arm, ranks in per_rank.items():
        error = next((r["error"] for r in ranks if r["error"]), None)
        outcomes[arm] = ArmOutcome(arm, ranks[0]["state"], ranks[0]["recorder"], [], 0.0, error)
        if arm != "native":
            diffs[arm] = [
                TensorDiff(
                    f"rank{r}/{d.name}", d.problem, d.max_abs, d.max_ulp, d.mismatched, d.numel
                )
                for r, (n, o) in enumerate(zip(native, ranks, strict=True))
                for d in diff_states(n["state"], o["state"])
            ]
    for arm in names:
        if arm in ("replay", "step") and not ranks_agree(per_rank[arm]):
            diffs[arm].append(TensorDiff("ranks/disagree", "values"))
    return ScenarioResult(scenario, outcomes, diffs)


def run_matrix_scenario(
    scenario: Scenario, arms: tuple[str, ...], timeout: float, work_dir: Path | None = None
) -> dict[str, Any]:
    """One matrix scenario as one torchrun job: a row of :mod:`.ddp_matrix`'s reports; a job
    that fails or outlives ``timeout`` is a failed row saying why."""
    start = time.perf_counter()
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "precision": scenario.precision,
        "accumulation": scenario.accumulation,
        "optimizer": scenario.optimizer,
        "clip": scenario.clip,
        "clip_algorithm": scenario.clip_algorithm if scenario.clip is not None else None,
        "devices": scenario.devices,
        "one_device": scenario.one_device,
        "arms": {},
        "error": None,
    }
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        try:
            outcomes = launch(scenario, ("native", *arms), Path(tmp), timeout)
        except RuntimeError as exc:
            row["error"] = str(exc)
            outcomes = None
    if outcomes is not None:
        native = outcomes["native"]
        row["native_steps"] = [int(o["state"]["progress/global_step"]) for o in native]
        row["native_errors"] = [o["error"] for o in native]
        for arm in arms:
            ranks = outcomes[arm]
            row["arms"][arm] = arm_report(arm, native, ranks, ranks_agree(ranks))
    row["ok"] = passed(row)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run_matrix(
    scenarios: list[Scenario],
    jobs: int = 1,
    timeout: float = 600,
    unsafe: bool = True,
    work_dir: Path | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every scenario's ``replay`` and ``step`` arms (the first scenario's unsafe arm too), ``jobs``
    torchrun jobs at a time (threads only wait on them); rows in the scenarios' order, ``report``
    sees each as it finishes."""
    arms_of = [
        ("replay", STEP_ARM, *((UNSAFE_ARM,) if unsafe and i == 0 and _exercises(s) else ()))
        for i, s in enumerate(scenarios)
    ]
    rows: list[dict[str, Any]] = [{}] * len(scenarios)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            pool.submit(run_matrix_scenario, s, arms, timeout, work_dir): i
            for i, (s, arms) in enumerate(zip(scenarios, arms_of, strict=True))
        }
        for future in as_completed(futures):
            rows[futures[future]] = future.result()
            if report is not None:
                report(rows[futures[future]])
    return rows


def _exercises(scenario: Scenario) -> bool:
    return UNSAFE_ARM[len(STEP_UNSAFE) :] in scenario.step_exercised()


def matrix_main(args: argparse.Namespace) -> int:
    """``--matrix``: a line per scenario as it finishes, the total, the JSON and markdown files;
    exit status 0 when every scenario passed."""
    scenarios = ddp_scenarios(
        args.precisions.split(","),
        [int(a) for a in args.accumulations.split(",")],
        args.task,
        args.devices,
        args.device,
        args.one_device,
    )
    cuda = args.device.startswith("cuda")
    transport = "one device, gloo" if args.one_device else ("nccl" if cuda else "gloo")
    print(
        f"DDP parity matrix: {len(scenarios)} scenarios x{args.devices} ranks ({args.device}, "
        f"{transport}), {args.jobs} job(s) at a time, {args.timeout:.0f} s per job",
        flush=True,
    )
    stop_jobs_on_sigterm()
    meta = {
        "task": args.task,
        "devices": args.devices,
        "device": args.device,
        "transport": transport,
        "jobs": args.jobs,
        "timeout_s": args.timeout,
        "torch": torch.__version__,
    }
    done: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        print(line(row), flush=True)
        done.append(row)
        if args.json is not None:  # what finished survives a driver stopped later
            args.json.write_text(json.dumps({**meta, "partial": True, "rows": done}, default=str))

    rows = run_matrix(
        scenarios, jobs=args.jobs, timeout=args.timeout, unsafe=not args.no_unsafe, report=report
    )
    summary = total(rows)
    print(summary, flush=True)
    if args.json is not None:
        args.json.write_text(
            json.dumps({**meta, "line": summary, "rows": rows}, indent=1, default=str)
        )
    if args.md is not None:
        title = f"Lightning DDP parity matrix ({args.devices} ranks, {args.device}, {transport})"
        args.md.write_text(markdown(rows, title))
    return 0 if rows and all(r["ok"] for r in rows) else 1


def _brief(summary: dict[str, Any]) -> str:
    """A journal summary's replays, eager reasons and retirement (the optimizer step's too)."""
    keys = ("record", "replay", "eager_reasons", "retired")
    out = {k: summary.get(k) for k in keys}
    step = summary.get("optimizer_step")
    if step:
        out["optimizer_step"] = {k: step.get(k) for k in (*keys, "refused")}
    return json.dumps(out, default=str)


def _worker(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    scenario = Scenario(
        **{
            k: tuple(map(tuple, v)) if k == "accumulation_schedule" and v else v
            for k, v in spec["scenario"].items()
        }
    )
    quiet_replay_warnings()
    rank = int(os.environ.get("RANK", "0"))
    for arm in spec["arms"]:
        outcome = run_arm(scenario, arm)
        torch.save(
            {"state": outcome.state, "recorder": outcome.recorder, "error": outcome.error},
            spec_path.with_name(f"{spec_path.stem}.{_file(arm)}.rank{rank}.pt"),
        )


def main(argv: list[str] | None = None) -> int:
    ap = worker_parser(__doc__)
    ap.add_argument("--task", default="detection")
    ap.add_argument("--precision", default="32")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    one_device_option(ap)
    ap.add_argument("--n-train", type=int, default=None, help="training samples (all ranks)")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--arms", default="native,replay", help="comma-separated: native,replay,step")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the job is killed")
    ap.add_argument(
        "--matrix",
        action="store_true",
        help="every precision x accumulation scenario (replay and step arms; see ddp_matrix)",
    )
    ap.add_argument(
        "--precisions", default="32,bf16-mixed,16-mixed", help="--matrix: comma-separated"
    )
    ap.add_argument("--accumulations", default="1,2,4", help="--matrix: comma-separated")
    ap.add_argument("--jobs", type=int, default=1, help="--matrix: torchrun jobs at a time")
    ap.add_argument("--no-unsafe", action="store_true", help="--matrix: without the unsafe arm")
    ap.add_argument("--json", type=Path, default=None, help="--matrix: write the rows here")
    ap.add_argument("--md", type=Path, default=None, help="--matrix: write a markdown table here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.matrix:
        return matrix_main(args)
    scenario = Scenario(
        task=args.task,
        precision=args.precision,
        accumulation=args.accumulation,
        devices=args.devices,
        device=args.device,
        one_device=args.one_device,
        n_train=args.n_train,
        clip=args.clip,
        optimizer=args.optimizer,
    )
    result = compare(scenario, tuple(args.arms.split(",")), args.timeout)
    print(
        f"{result['scenario']} x{args.devices} ({'one device, gloo' if args.one_device else 'ddp'}, "
        f"arms {args.arms}): ok={result['ok']}; replay equal to native on every rank: "
        f"{result['equal']}; ranks agree: {result['ranks_agree']}; optimizer steps per rank: {result['steps']}; "
        f"replayed optimizer steps per rank (step arm): {result['step_replays']}"
    )
    for arm, ranks in result["recorders"].items():
        for rank, rec in enumerate(ranks):
            if rec:
                print(f"  {arm} rank {rank}: {_brief(rec)}")
    print(json.dumps({"errors": result["errors"]}, default=str)[:3000])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
