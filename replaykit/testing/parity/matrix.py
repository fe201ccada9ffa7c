"""The parity matrix: task x precision x accumulation x layout scenarios, run one by one,
and the tables (rows, diff rows, summary) a notebook renders from their results."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

from ..progress import run_each
from .arms import STEP_ARM, run_scenario, step_unsafe_arms, unsafe_arms
from .scenario import (
    JOURNAL_SUMMARY,
    PRECISIONS,
    VERDICT_COLUMNS,
    Scenario,
    ScenarioResult,
    automatic_step_choice,
    journal_counts,
    median_steady,
)


def matrix(
    tasks: Iterable[str] = ("detection", "pose", "oriented", "segmentation"),
    precisions: Iterable[str] = PRECISIONS,
    accumulations: Iterable[int] = (1, 2, 3),
    layouts: Iterable[str] = ("contiguous", "channels_last"),
    partial_layouts: Iterable[str] = ("partial_last", "partial_between"),
    partial_accumulation: int = 2,
    **common: Any,
) -> list[Scenario]:
    """task x precision x accumulation x layout, plus the partial-batch layouts at one accumulation."""
    tasks, precisions = list(tasks), list(precisions)
    out = [
        Scenario(task=t, precision=p, accumulation=a, layout=lay, **common)
        for t, p, a, lay in itertools.product(tasks, precisions, accumulations, layouts)
    ]
    out += [
        Scenario(task=t, precision=p, accumulation=partial_accumulation, layout=lay, **common)
        for t, p, lay in itertools.product(tasks, precisions, partial_layouts)
    ]
    return out


def automatic_matrix(
    tasks: Iterable[str] = ("detection", "pose", "oriented", "segmentation"),
    precisions: Iterable[str] = ("32", "bf16-mixed"),
    accumulations: Iterable[int] = (1, 2, 4),
    layouts: Iterable[str] = ("contiguous", "channels_last"),
    partial_layouts: Iterable[str] = ("partial_last", "partial_between"),
    partial_accumulation: int = 2,
    n_train: int = 48,
    **common: Any,
) -> list[Scenario]:
    """The automatic-optimization step arm's matrix: task x precision x accumulation x layout, plus
    the partial-batch layouts at one accumulation (4 x 3 x (3 x 2 + 2) = 96 with every precision).

    Clipping alternates norm and value by accumulation. 12 batches of 4 give accumulation 4 three
    optimizer steps: a warm-up, a recording, a replay. ``optimizer="auto"``: plain SGD, except
    under ``16-mixed``, whose GradScaler replays with a fused optimizer only (a non-fused
    ``scaler.step`` reads ``found_inf`` on the host). Lightning's mixed precision does not let a
    fused optimizer clip (it unscales internally): scenarios with one run unclipped.
    """
    chosen = str(common.pop("optimizer", "auto"))

    def one(t: str, p: str, a: int, lay: str) -> Scenario:
        optimizer, clip, algorithm = automatic_step_choice(p, a, chosen)
        partial = lay.startswith("partial")
        return Scenario(
            task=t,
            precision=p,
            accumulation=a,
            layout=lay,
            n_train=n_train - 2 if partial else n_train,
            clip=clip,
            clip_algorithm=algorithm,
            optimizer=optimizer,
            **common,
        )

    tasks, precisions = list(tasks), list(precisions)
    out = [one(*c) for c in itertools.product(tasks, precisions, accumulations, layouts)]
    out += [
        one(t, p, partial_accumulation, lay)
        for t, p, lay in itertools.product(tasks, precisions, partial_layouts)
    ]
    return out


def run_matrix(
    scenarios: Iterable[Scenario],
    with_unsafe: bool = False,
    progress: bool = True,
    arm: str = "replay",
) -> Iterator[ScenarioResult]:
    """Run scenarios one by one (a tqdm bar when ``progress``), yielding each result as it comes.

    ``arm``: ``replay`` (network replay) or ``step`` (network replay and the optimizer step under
    automatic optimization), each with its own unsafe arms."""

    def run(scenario: Scenario) -> ScenarioResult:
        unsafe = step_unsafe_arms if arm == STEP_ARM else unsafe_arms
        arms = [arm, *(unsafe(scenario) if with_unsafe else [])]
        if scenario.devices > 1:  # each arm as DDP processes under torchrun
            from .ddp import run_scenario as run_ddp  # torch.distributed only when asked

            return run_ddp(scenario, ("native", *arms))
        return run_scenario(scenario, arms)

    yield from run_each(
        list(scenarios),
        run,
        "parity",
        progress,
        lambda s, r: f"{s.name}: {'pass' if r.passed else 'FAIL'}",
    )


def diff_rows(results: Iterable[ScenarioResult], limit: int = 20) -> list[dict[str, Any]]:
    """The diff table: per scenario and non-native arm, one row per tensor that differs
    (name, problem, max abs diff, max ULP distance, mismatched elements), ``limit`` rows at most each."""
    out = []
    for r in results:
        for arm, diffs in r.diffs.items():
            out += [{"scenario": r.scenario.name, "arm": arm, **d.as_dict()} for d in diffs[:limit]]
    return out


def summary(results: Iterable[ScenarioResult]) -> dict[str, Any]:
    """Counts for a run's summary.json, and the one line an engineering log quotes."""
    results = list(results)
    table = rows(results)
    replay = [r for r in table if r["arm"] in ("replay", STEP_ARM)]
    unsafe = [r for r in table if r["arm"] not in ("replay", STEP_ARM)]
    diverged = [r for r in unsafe if not r["equal"]]
    line = (
        f"{sum(r.passed for r in results)}/{len(results)} scenarios passed; replay arm: "
        f"{sum(r['equal'] for r in replay)}/{len(replay)} bitwise equal; unsafe arms: "
        f"{len(diverged)}/{len(unsafe)} diverged"
    )
    return {
        "line": line,
        "scenarios": len(results),
        "passed": sum(r.passed for r in results),
        "failed": [r.scenario.name for r in results if not r.passed],
        "replay_equal": sum(r["equal"] for r in replay),
        "replay_cases": len(replay),
        "unsafe_diverged": len(diverged),
        "unsafe_cases": len(unsafe),
    }


def _must_diverge(scenario: Scenario, arm: str) -> bool:
    kind, _, name = arm.partition(":")
    if kind == "unsafe":
        return name in scenario.exercised()
    return kind == "step-unsafe" and name in scenario.step_exercised()


def rows(results: Iterable[ScenarioResult]) -> list[dict[str, Any]]:
    """One row per scenario and non-native arm: pass/fail, diff summary, journal summary, step times."""
    out = []
    for r in results:
        native = r.arms["native"]
        for name, arm in r.arms.items():
            if name == "native":
                continue
            diffs = r.diffs.get(name, [])
            rec = arm.recorder or {}
            out.append(
                {
                    **{k: v for k, v in asdict(r.scenario).items() if k not in ("device",)},
                    "scenario": r.scenario.name,
                    "arm": name,
                    "expected": "diverge" if _must_diverge(r.scenario, name) else "equal",
                    "equal": r.equal(name),
                    "ok": r.ok(name),
                    "tensors_differing": len(diffs),
                    "max_abs_diff": max(
                        (d.max_abs for d in diffs if d.problem == "values"), default=0.0
                    ),
                    "none_pattern_diffs": sum(d.problem == "none_pattern" for d in diffs),
                    "recordings": rec.get("record", 0),
                    **journal_counts(rec),
                    "step_replays": (rec.get("optimizer_step") or {}).get("replay", 0),
                    "step_eager_reasons": (rec.get("optimizer_step") or {}).get(
                        "eager_reasons", {}
                    ),
                    "step_retired": (rec.get("optimizer_step") or {}).get("retired"),
                    "native_step_ms": median_steady(native.step_ms),
                    "arm_step_ms": median_steady(arm.step_ms),
                    "error": arm.error or native.error,
                }
            )
    return out


_KEYS = (
    *(k for k in Scenario.__dataclass_fields__ if k != "device"),
    *VERDICT_COLUMNS,
    "max_abs_diff",
    "none_pattern_diffs",
    *JOURNAL_SUMMARY,
    "step_replays",
    "step_eager_reasons",
    "step_retired",
    "native_step_ms",
    "arm_step_ms",
    "error",
)


def frame(results: Iterable[ScenarioResult]):
    """The rows as a pandas DataFrame (what the notebooks render); no scenarios (a zoo-only run): no
    rows, but every column."""
    import pandas as pd

    return pd.DataFrame(rows(results), columns=list(_KEYS))
