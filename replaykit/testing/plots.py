"""What the notebooks show: styled pass/fail tables, the parity heatmap (max ULP distance per
scenario and arm), gradient diffs and step-time ratios. A plot that leaves data out says what."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .parity.scenario import JOURNAL_SUMMARY, VERDICT_COLUMNS, ScenarioResult, steady_steps

ZERO_FLOOR = 1e-12  # where a bitwise-equal tensor is drawn on a log axis

RESULT_COLUMNS = [
    *VERDICT_COLUMNS,
    "max_abs_diff",
    "none_pattern_diffs",
    "error",
]
JOURNAL_COLUMNS = ["scenario", *JOURNAL_SUMMARY]


def pd_table(rows: Sequence[dict[str, Any]]) -> Any:
    """Rows of dicts as a DataFrame."""
    import pandas as pd

    return pd.DataFrame(list(rows))


def fingerprint_rows(fp: dict[str, Any]) -> list[dict[str, Any]]:
    """The fingerprint as (key, value) rows, the tree flattened."""
    tree = fp.get("tree") or {}
    flat = {f"tree.{k}": v for k, v in tree.items() if k in ("source", "commit", "dirty", "sha256")}
    flat.update({k: v for k, v in fp.items() if k != "tree"})
    return [{"key": k, "value": v} for k, v in flat.items()]


def style_results(df: Any) -> Any:
    """The result table with ok/equal cells green or red (a pandas Styler)."""

    def colour(value: Any) -> str:
        if value is True:
            return "background-color: #c8e6c9"
        if value is False:
            return "background-color: #ffcdd2"
        return ""

    cols = [c for c in ("ok", "equal") if c in df.columns]
    styler = df.style
    apply = getattr(styler, "map", None) or styler.applymap  # pandas < 2.1 has applymap only
    return apply(colour, subset=cols)


def per_parameter_diffs(result: ScenarioResult, arm: str) -> dict[str, float]:
    """Max abs diff against native for each parameter, over its value and every step's gradient.

    0.0 means bitwise equal; inf marks a None-pattern mismatch or a non-finite difference.
    """
    names = [k[len("param/") :] for k in result.arms["native"].state if k.startswith("param/")]
    out = dict.fromkeys(names, 0.0)
    for d in result.diffs.get(arm, []):
        name = _parameter_of(d.name)
        if name in out:
            value = math.inf if d.problem != "values" else d.max_abs
            out[name] = max(out[name], value)
    return out


def _parameter_of(key: str) -> str | None:
    """The parameter a state key is about: ``param/NAME``, ``grad/NAME``, ``grad/stepK/NAME``."""
    kind, _, rest = key.partition("/")
    if kind == "param":
        return rest
    if kind == "grad":
        head, _, tail = rest.partition("/")
        return tail if head.startswith("step") and head[4:].isdigit() and tail else rest
    return None


def _left_out(
    fig: Any, plot: str, groups: Sequence[tuple[str, Sequence[str]]], shown: int = 3
) -> str:
    """Print what ``plot`` does not show, and say it under the figure; lay the figure out.

    A plot that drops scenarios without a word reads as "all is well" for the ones it dropped.
    ``groups`` are (reason, names); the printout lists every name, the figure the first ``shown``.
    Returns the printed note ("" when nothing was left out).
    """
    groups = [(why, list(names)) for why, names in groups if names]
    note = "\n".join(f"{plot} leaves out {len(n)} {why}: {', '.join(n)}" for why, n in groups)
    width = int(fig.get_figwidth() * 15)  # characters of 7-point text per line
    lines = [
        line
        for why, n in groups
        for line in textwrap.wrap(
            f"left out: {len(n)} {why}: {', '.join(n[:shown])}{f' and {len(n) - shown} more (printed)' if len(n) > shown else ''}",
            width,
        )
    ]
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, min(0.5, (0.18 * len(lines) + 0.05) / height) if lines else 0, 1, 1))
    if note:
        print(note)
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, color="dimgrey", ha="left", va="bottom")
    return note


def plot_diffs(results: Sequence[ScenarioResult], max_panels: int = 6) -> Any:
    """Per-parameter max abs diff of each arm against native (log scale; equal drawn apart, at the floor).

    One panel per scenario where some arm differs (the first ``max_panels``; the first scenario
    when none differs). Says what it leaves out: the other scenarios, and differing tensors that
    are not a parameter or its gradient (buffers, optimizer, scaler, metrics): the ULP heatmap
    and the diff table have those.
    """
    import matplotlib.pyplot as plt

    differing = [r for r in results if any(not r.equal(a) for a in r.arms if a != "native")]
    panels = differing[:max_panels] or list(results[:1])
    drawn = {id(r) for r in panels} | {
        id(r) for r in differing
    }  # results hold tensors: compare by identity
    equal = [r.scenario.name for r in results if id(r) not in drawn]
    beyond = [r.scenario.name for r in differing[max_panels:]]
    other_tensors = []
    for r in panels:
        for arm, ds in r.diffs.items():
            params = per_parameter_diffs(r, arm)
            k = sum(_parameter_of(d.name) not in params for d in ds)
            if k:
                other_tensors.append(f"{r.scenario.name} [{arm}]: {k}")
    fig, axes = plt.subplots(
        max(1, len(panels)), 1, figsize=(11, 2.8 * max(1, len(panels))), squeeze=False
    )
    for ax, r in zip(axes[:, 0], panels, strict=False):
        for k, arm in enumerate(a for a in r.arms if a != "native"):
            diffs = per_parameter_diffs(r, arm)
            xs = list(range(len(diffs)))
            ys = [
                v if 0 < v < math.inf else (1e6 if v == math.inf else ZERO_FLOOR)
                for v in diffs.values()
            ]
            equal_at = [v == 0 for v in diffs.values()]
            ax.scatter(
                [x for x, e in zip(xs, equal_at, strict=True) if not e],
                [y for y, e in zip(ys, equal_at, strict=True) if not e],
                label=f"{arm}: differs",
                marker="o",
                s=18,
                color=f"C{k}",
            )
            ax.scatter(
                [x for x, e in zip(xs, equal_at, strict=True) if e],
                [ZERO_FLOOR] * sum(equal_at),
                label=f"{arm}: bitwise equal",
                marker="_",
                s=60,
                color=f"C{k}",
                alpha=0.6,
            )
        ax.set_yscale("log")
        ax.set_ylim(ZERO_FLOOR / 3, 1e7)
        ax.axhline(ZERO_FLOOR * 3, color="grey", lw=0.5, ls=":")
        ax.set_title(r.scenario.name, fontsize=9)
        ax.set_ylabel("max |diff| vs native")
        ax.set_xticks([])
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel(
        "parameters of net (value and every step's gradient); inf = None-pattern mismatch, drawn at 1e6"
    )
    _left_out(
        fig,
        "the gradient-diff plot",
        [
            ("scenarios where every arm is bitwise equal", equal),
            (f"differing scenarios beyond the first {max_panels}", beyond),
            (
                "drawn arms with differing tensors that are not a parameter or its gradient (buffers, optimizer, scaler, metrics: see the ULP heatmap), tensors per arm",
                other_tensors,
            ),
        ],
    )
    return fig


@dataclass(frozen=True)
class StepRatio:
    """One bar of the step-time chart: replay over native for one scenario."""

    scenario: str
    ratio: float  # median replay step ms / median native step ms, steady steps
    low: float  # p10 of the per-step ratios (step k of replay / step k of native)
    high: float  # p90 of the same
    steps: int  # steady steps paired


def step_ratios(
    results: Sequence[ScenarioResult], arm: str = "replay"
) -> tuple[list[StepRatio], list[tuple[str, list[str]]]]:
    """Replay/native step time per scenario, sorted, and the scenarios that have none (with why).

    A ratio, not two lines of milliseconds: scenarios differ in cost, and replay's promise is
    relative. The band is the p10-p90 of per-step ratios, step k of ``arm`` over step k of
    native (same batch, so batch-size differences cancel); the matrix runs each arm once, so
    steps are the only repeats there are. Warm-up steps are dropped (:func:`steady_steps`).
    """
    import numpy as np

    out: list[StepRatio] = []
    no_arm, raised, no_times = [], [], []
    for r in results:
        name = r.scenario.name
        if arm not in r.arms:
            no_arm.append(name)
            continue
        native, other = r.arms["native"], r.arms[arm]
        if native.error or other.error:
            raised.append(name)
            continue
        a, b = steady_steps(other.step_ms), steady_steps(native.step_ms)
        n = min(len(a), len(b))
        if n == 0 or statistics.median(b) <= 0:
            no_times.append(name)
            continue
        per_step = np.asarray(a[:n]) / np.maximum(np.asarray(b[:n]), 1e-9)
        low, high = np.percentile(per_step, [10, 90])
        out.append(
            StepRatio(name, statistics.median(a) / statistics.median(b), float(low), float(high), n)
        )
    out.sort(key=lambda s: s.ratio)
    left_out = [
        (f"scenarios without a {arm} arm", no_arm),
        ("scenarios where an arm raised (its times are of a run that stopped)", raised),
        ("scenarios without step times", no_times),
    ]
    return out, [(why, names) for why, names in left_out if names]


def plot_step_ratios(results: Sequence[ScenarioResult], arm: str = "replay") -> Any:
    """Step time of ``arm`` relative to native, one sorted bar per scenario, a line at 1.0.

    Bars are the ratio of median steady-state step times; whiskers the p10-p90 of per-step
    ratios (see :func:`step_ratios`). Scenarios with no ratio are printed and noted under it.
    """
    import matplotlib.pyplot as plt

    ratios, left_out = step_ratios(results, arm)
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.22 * max(1, len(ratios))))
    ys = list(range(len(ratios)))
    ax.barh(ys, [s.ratio for s in ratios], color="C0", alpha=0.8, height=0.7)
    ax.hlines(ys, [s.low for s in ratios], [s.high for s in ratios], color="black", lw=1.2)
    ax.axvline(1.0, color="grey", lw=1, ls="--")
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{s.scenario}  {s.ratio:.2f}" for s in ratios], fontsize=6)
    ax.set_ylim(-0.7, max(1, len(ratios)) - 0.3)
    steps = sorted({s.steps for s in ratios})
    n = "" if not steps else f"n={steps[0]}" if len(steps) == 1 else f"n={steps[0]}-{steps[-1]}"
    ax.set_xlabel(
        f"{arm} / native, median step time (< 1: {arm} faster; dashed: 1.0)\n"
        f"whisker: p10-p90 of per-step ratios, step k of {arm} / step k of native ({n} steady steps, warm-up dropped)",
        fontsize=8,
    )
    ax.set_title(f"{arm} step time relative to native, per scenario (sorted)", fontsize=9)
    _left_out(fig, "the step-time chart", left_out)
    return fig


@dataclass(frozen=True)
class UlpCell:
    """One scenario x arm cell of the parity heatmap."""

    max_ulp: int  # over floating tensors whose values differ; 0 when none does
    unmeasured: int  # differing tensors ULPs do not measure: None pattern, dtype, shape, missing, integers, -0.0 vs 0.0
    error: bool  # the arm (or native) raised
    ok: bool  # what the arm is expected to do (replay: equal; an exercised unsafe arm: diverge)

    @property
    def equal(self) -> bool:
        return not (self.max_ulp or self.unmeasured or self.error)

    @property
    def label(self) -> str:
        """The cell's text: 0, the ULP distance, '≠' for differences without one, 'error'."""
        if self.error:
            return "error"
        if not self.max_ulp:
            return "≠" if self.unmeasured else "0"
        text = (
            str(self.max_ulp)
            if self.max_ulp < 1000
            else f"{self.max_ulp:.0e}".replace("e+0", "e").replace("e+", "e")
        )
        return text + ("*" if self.unmeasured else "")


def ulp_cells(
    results: Sequence[ScenarioResult],
) -> tuple[list[str], list[str], dict[tuple[str, str], UlpCell]]:
    """Rows (every scenario, in order), columns (non-native arms, replay first) and the cells
    present; a (scenario, arm) missing from the cells was not run (the protection is not exercised)."""
    scenarios = [r.scenario.name for r in results]
    arms = sorted(
        {a for r in results for a in r.arms if a != "native"}, key=lambda a: (a != "replay", a)
    )
    cells = {}
    for r in results:
        for arm in r.arms:
            if arm == "native":
                continue
            diffs = r.diffs.get(arm, [])
            ulps = [d.max_ulp for d in diffs if d.problem == "values" and d.max_ulp > 0]
            cells[r.scenario.name, arm] = UlpCell(
                max_ulp=max(ulps, default=0),
                unmeasured=len(diffs) - len(ulps),
                error=bool(r.arms[arm].error or r.arms["native"].error),
                ok=r.ok(arm),
            )
    return scenarios, arms, cells


EQUAL_COLOUR, UNMEASURED_COLOUR, ERROR_COLOUR, NOT_RUN_COLOUR = (
    "#e8f5e9",
    "#9e9e9e",
    "#212121",
    "#f5f5f5",
)


def plot_ulp_heatmap(results: Sequence[ScenarioResult]) -> Any:
    """Parity at a glance: max ULP distance from native over every tensor, per scenario and arm.

    Every scenario is a row, equal or not (an all-equal row is the good news). Bitwise equal
    (0) has a colour of its own rather than the bottom of the scale; ULP distances are on a log
    scale (unsafe arms are expected above 0); differences ULPs do not measure are grey ('≠', or
    '*' beside a distance), a raised arm black, an arm not run blank. A red frame marks a failed
    case: replay not equal, or an unsafe arm that should diverge and did not.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, to_rgba
    from matplotlib.patches import Patch, Rectangle

    scenarios, arms, cells = ulp_cells(results)
    n, m = max(1, len(scenarios)), max(1, len(arms))
    peak = max((c.max_ulp for c in cells.values()), default=0)
    norm, cmap = LogNorm(vmin=1, vmax=max(10, peak)), plt.get_cmap("viridis")
    rgba = np.tile(to_rgba(NOT_RUN_COLOUR), (n, m, 1))
    fig, (ax, cax) = plt.subplots(
        1, 2, figsize=(4.5 + 1.1 * m, 2.2 + 0.22 * n), gridspec_kw={"width_ratios": [1, 0.04]}
    )
    for i, s in enumerate(scenarios):
        for j, arm in enumerate(arms):
            cell = cells.get((s, arm))
            if cell is None:
                ax.text(j, i, "–", ha="center", va="center", fontsize=6, color="grey")
                continue
            if cell.error:
                colour = to_rgba(ERROR_COLOUR)
            elif cell.max_ulp:
                colour = cmap(norm(cell.max_ulp))
            else:
                colour = to_rgba(UNMEASURED_COLOUR if cell.unmeasured else EQUAL_COLOUR)
            rgba[i, j] = colour
            dark = cell.error or (cell.max_ulp and norm(cell.max_ulp) < 0.6)
            ax.text(
                j,
                i,
                cell.label,
                ha="center",
                va="center",
                fontsize=6,
                color="white" if dark else "black",
            )
            if not cell.ok:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
    ax.imshow(rgba, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(arms)), arms, fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(scenarios)), scenarios, fontsize=6)
    ax.set_xticks(np.arange(-0.5, m), minor=True)
    ax.set_yticks(np.arange(-0.5, n), minor=True)
    ax.grid(which="minor", color="white", lw=0.5)
    ax.tick_params(which="minor", length=0)
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap), cax=cax, label="max ULP distance vs native (log)"
    )
    ax.legend(
        handles=[
            Patch(facecolor=EQUAL_COLOUR, edgecolor="grey", label="0: bitwise equal"),
            Patch(
                facecolor=UNMEASURED_COLOUR,
                label="≠ / *: differs where ULPs do not measure (None pattern, dtype, shape, missing, integers, ±0)",
            ),
            Patch(facecolor=ERROR_COLOUR, label="error: an arm raised"),
            Patch(
                facecolor=NOT_RUN_COLOUR,
                edgecolor="grey",
                label="–: not run (protection not exercised)",
            ),
            Patch(
                facecolor="none",
                edgecolor="red",
                lw=2,
                label="failed: replay differs, or an unsafe arm did not diverge",
            ),
        ],
        loc="upper left",
        bbox_to_anchor=(0, -0.01),
        fontsize=6,
        frameon=False,
    )
    _left_out(fig, "the ULP heatmap", [])
    return fig


def plot_bench(rows: Sequence[dict[str, Any]]):
    """Benchmark medians per size and arm, and peak memory, side by side."""
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 3.5))
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        by = {r["size"]: r for r in rows if r["arm"] == arm}
        xs = [i + k * width for i in range(len(sizes))]
        ax_t.bar(xs, [by[s]["median_ms"] if s in by else 0 for s in sizes], width, label=arm)
        ax_m.bar(xs, [by[s]["peak_mib"] if s in by else 0 for s in sizes], width, label=arm)
    for ax, label in ((ax_t, "median ms per step"), (ax_m, "peak MiB")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
        ax.set_xticklabels(sizes)
        ax.set_ylabel(label)
        if any(0 < p.get_height() < math.inf for p in ax.patches):
            ax.set_yscale("log")
    if not any(0 < r["peak_mib"] < math.inf for r in rows):
        ax_m.text(
            0.5, 0.5, "no CUDA memory statistics on a CPU", ha="center", transform=ax_m.transAxes
        )
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    return fig
