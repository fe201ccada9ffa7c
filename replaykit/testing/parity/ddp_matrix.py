"""The parity matrix under Lightning DDP: its scenarios (precision x accumulation) and its
reports (a line per scenario, the total, a markdown table). :mod:`replaykit.testing.parity.ddp`
runs it (``--matrix``):

    python -m replaykit.testing.parity.ddp --matrix [--accumulations 1,2,4]
        [--precisions 32,bf16-mixed,16-mixed] [--jobs 3] [--timeout 120]
        [--device cuda [--one-device]] [--json out.json] [--md out.md]

Each scenario is one torchrun job training ``native``, network replay (``replay``:
``ReplayCallback("net")``) and the automatic step (``step``: ``ReplayCallback("net",
optimizer_step=True)``) one after another in the same processes; the first scenario adds
``step-unsafe:grad_inputs``, which must diverge. A scenario passes when both replaying arms
equal native bit for bit on every rank, their ranks agree, the network replayed on every rank
and the optimizer step replayed on every rank.

Optimizer and clipping are the automatic matrix's
(:func:`~replaykit.testing.parity.scenario.automatic_step_choice`): plain SGD, ``sgd-fused``
only under 16-mixed (whose GradScaler replays with a fused optimizer only), and no clipping
where a fused optimizer meets mixed precision (Lightning refuses it). Every rank trains three
optimizer steps (warm-up, recording, replay): ``n_train`` grows with accumulation and ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from ...verify.bitwise import diff_states
from .arms import STEP_ARM, STEP_UNSAFE
from .scenario import Scenario, automatic_step_choice

#: Optimizer steps every rank trains: a warm-up, a recording, a replay.
STEPS_PER_RANK = 3
#: The unsafe arm the first scenario adds (when the scenario exercises it).
UNSAFE_ARM = f"{STEP_UNSAFE}grad_inputs"


def ddp_scenarios(
    precisions: Iterable[str] = ("32", "bf16-mixed", "16-mixed"),
    accumulations: Iterable[int] = (1, 2, 4),
    task: str = "detection",
    devices: int = 2,
    device: str = "cpu",
    one_device: bool = False,
) -> list[Scenario]:
    """precision x accumulation for one task (contiguous layout) as ``devices`` DDP ranks, with
    the automatic matrix's optimizer and clipping, each rank training :data:`STEPS_PER_RANK`
    optimizer steps."""
    out = []
    for p, a in itertools.product(precisions, accumulations):
        optimizer, clip, algorithm = automatic_step_choice(p, a)
        s = Scenario(
            task=task,
            precision=p,
            accumulation=a,
            clip=clip,
            clip_algorithm=algorithm,
            optimizer=optimizer,
            devices=devices,
            device=device,
            one_device=one_device,
        )
        out.append(dataclasses.replace(s, n_train=s.batch_size * a * STEPS_PER_RANK * devices))
    return out


def arm_report(
    arm: str, native: list[dict[str, Any]], ranks: list[dict[str, Any]], agree: bool
) -> dict[str, Any]:
    """One arm on every rank: equal to that rank's native, the ranks' agreement (``agree``),
    what replayed, why not, and whether the arm passed."""
    recs = [o["recorder"] or {} for o in ranks]
    steps = [r.get("optimizer_step") or {} for r in recs]
    diffs = [diff_states(n["state"], o["state"]) for n, o in zip(native, ranks, strict=True)]
    report = {
        "equal": [not d and o["error"] is None for d, o in zip(diffs, ranks, strict=True)],
        "ranks_agree": agree,
        "net_replays": [r.get("replay", 0) for r in recs],
        "step_replays": [s.get("replay", 0) for s in steps],
        "eager_reasons": [r.get("eager_reasons", {}) for r in recs],
        "step_eager_reasons": [s.get("eager_reasons", {}) for s in steps],
        "retired": [r.get("retired") for r in recs],
        "step_retired": [s.get("retired") for s in steps],
        "diffs": [[f"{d.name}: {d.problem}" for d in ds[:5]] for ds in diffs],
        "errors": [o["error"] for o in ranks],
    }
    report["ok"] = verdict(arm, report)
    return report


def passed(row: dict[str, Any]) -> bool:
    """A scenario passed: its job finished, native trained on every rank, every arm passed."""
    return (
        row["error"] is None
        and not any(row.get("native_errors", ()))
        and all(report["ok"] for report in row["arms"].values())
    )


def verdict(arm: str, report: dict[str, Any]) -> bool:
    """Replaying arms: equal on every rank, ranks agree, replayed on every rank (the step arm:
    the optimizer step too); an unsafe arm must differ from native on some rank."""
    if arm.startswith(STEP_UNSAFE):  # a crash is no divergence
        return not any(report["errors"]) and not all(report["equal"])
    replayed = min(report["net_replays"], default=0) > 0
    if arm == STEP_ARM:
        replayed = replayed and min(report["step_replays"], default=0) > 0
    return all(report["equal"]) and report["ranks_agree"] and replayed


def _flags(values: list[bool]) -> str:
    return "/".join("yes" if v else "NO" for v in values) or "-"


def line(row: dict[str, Any]) -> str:
    """One scenario's line: each arm per rank, the ranks' agreement, replay counts, or the error."""
    head = f"{'pass' if row['ok'] else 'FAIL'} {row['scenario']} ({row['optimizer']})"
    if row["error"]:
        return f"{head}: {row['error'].splitlines()[0]}"
    parts = []
    for arm, r in row["arms"].items():
        if arm.startswith(STEP_UNSAFE):
            outcome = "diverged" if r["ok"] else "DID NOT DIVERGE"
            if any(r["errors"]):
                outcome = f"CRASHED ({next(e for e in r['errors'] if e)})"
            parts.append(f"{arm} {outcome} (must diverge)")
            continue
        text = (
            f"{arm} equal per rank {_flags(r['equal'])}, ranks agree {_flags([r['ranks_agree']])}, "
            f"net replays {r['net_replays']}"
        )
        if arm == STEP_ARM:
            text += f", optimizer-step replays {r['step_replays']}"
        if any(r["errors"]):
            text += f", error {next(e for e in r['errors'] if e)}"
        elif not r["ok"]:  # what differs, and why something ran eagerly
            text += f", diffs {r['diffs']}, eager {r['eager_reasons']}, retired {r['retired']}"
            if arm == STEP_ARM:
                text += f", step eager {r['step_eager_reasons']}, step retired {r['step_retired']}"
        parts.append(text)
    return f"{head}: " + "; ".join(parts) + f" [{row['seconds']} s]"


def _agree(row: dict[str, Any]) -> bool:
    """Every replaying arm's ranks ended with the same weights (unsafe arms aside)."""
    arms = [a for name, a in row["arms"].items() if not name.startswith(STEP_UNSAFE)]
    return bool(arms) and all(a["ranks_agree"] for a in arms)


def total(rows: list[dict[str, Any]]) -> str:
    """The matrix's one line: how many scenarios passed, and each criterion's count."""

    def count(arm: str, test: Callable[[dict[str, Any]], bool]) -> int:
        return sum(1 for r in rows if arm in r["arms"] and test(r["arms"][arm]))

    unsafe = [r["arms"][UNSAFE_ARM] for r in rows if UNSAFE_ARM in r["arms"]]
    n = len(rows)
    return (
        f"{sum(r['ok'] for r in rows)}/{n} scenarios passed: replay equal on every rank "
        f"{count('replay', lambda a: all(a['equal']))}/{n}, step equal on every rank "
        f"{count(STEP_ARM, lambda a: all(a['equal']))}/{n}, ranks agree "
        f"{sum(_agree(r) for r in rows)}/{n}, "
        f"optimizer step replayed on every rank "
        f"{count(STEP_ARM, lambda a: min(a['step_replays'], default=0) > 0)}/{n}; "
        f"unsafe arms diverged {sum(a['ok'] for a in unsafe)}/{len(unsafe)}"
    )


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    """The matrix as a markdown table (one row per scenario), its total line above it."""
    out = [
        f"# {title}",
        "",
        total(rows),
        "",
        "| scenario | optimizer | clip | replay equal (per rank) | step equal (per rank) | ranks agree "
        "| net replays (replay arm) | optimizer-step replays | unsafe arm | ok | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        arms = r["arms"]
        rep, step = arms.get("replay"), arms.get(STEP_ARM)
        unsafe = arms.get(UNSAFE_ARM)
        clip = f"{r['clip']} {r['clip_algorithm']}" if r["clip"] is not None else "-"
        if r["error"]:
            cells = [f"error: {r['error'].splitlines()[0][:120]}", "", "", "", "", ""]
        else:
            cells = [
                _flags(rep["equal"]) if rep else "-",
                _flags(step["equal"]) if step else "-",
                _flags([_agree(r)]),
                str(rep["net_replays"]) if rep else "-",
                str(step["step_replays"]) if step else "-",
                ("diverged" if unsafe["ok"] else "DID NOT DIVERGE") if unsafe else "-",
            ]
        out.append(
            "| "
            + " | ".join(
                [
                    r["scenario"],
                    r["optimizer"],
                    clip,
                    *cells,
                    "pass" if r["ok"] else "FAIL",
                    str(r["seconds"]),
                ]
            )
            + " |"
        )
    return "\n".join(out) + "\n"
