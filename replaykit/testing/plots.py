"""What the notebooks show: styled pass/fail tables and the plots of gradient diffs and step times."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .scenario import ScenarioResult

ZERO_FLOOR = 1e-12  # where a bitwise-equal tensor is drawn on a log axis

RESULT_COLUMNS = [
    "scenario", "arm", "expected", "equal", "ok", "tensors_differing", "max_abs_diff", "none_pattern_diffs", "error",
]
JOURNAL_COLUMNS = [
    "scenario", "recordings", "replays", "eager", "eager_reasons", "backward_reasons", "retired",
]


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


def plot_diffs(results: Sequence[ScenarioResult], max_panels: int = 6):
    """Per-parameter max abs diff of each arm against native (log scale; equal drawn apart, at the floor)."""
    import matplotlib.pyplot as plt

    panels = []
    for r in results:
        arms = [a for a in r.arms if a != "native"]
        if any(not r.equal(a) for a in arms) or not panels:
            panels.append(r)
        if len(panels) >= max_panels:
            break
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.8 * len(panels)), squeeze=False)
    for ax, r in zip(axes[:, 0], panels, strict=True):
        for k, arm in enumerate(a for a in r.arms if a != "native"):
            diffs = per_parameter_diffs(r, arm)
            xs = list(range(len(diffs)))
            ys = [v if 0 < v < math.inf else (1e6 if v == math.inf else ZERO_FLOOR) for v in diffs.values()]
            equal = [v == 0 for v in diffs.values()]
            ax.scatter([x for x, e in zip(xs, equal, strict=True) if not e], [y for y, e in zip(ys, equal, strict=True) if not e],
                       label=f"{arm}: differs", marker="o", s=18, color=f"C{k}")
            ax.scatter([x for x, e in zip(xs, equal, strict=True) if e], [ZERO_FLOOR] * sum(equal),
                       label=f"{arm}: bitwise equal", marker="_", s=60, color=f"C{k}", alpha=0.6)
        ax.set_yscale("log")
        ax.set_ylim(ZERO_FLOOR / 3, 1e7)
        ax.axhline(ZERO_FLOOR * 3, color="grey", lw=0.5, ls=":")
        ax.set_title(r.scenario.name, fontsize=9)
        ax.set_ylabel("max |diff| vs native")
        ax.set_xticks([])
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("parameters of net (value and every step's gradient); inf = None-pattern mismatch, drawn at 1e6")
    fig.tight_layout()
    return fig


def plot_step_times(df: Any):
    """Median step time of native vs replay per scenario (replay arm rows only)."""
    import matplotlib.pyplot as plt

    rows = df[df["arm"] == "replay"]
    fig, ax = plt.subplots(figsize=(11, 3.5))
    xs = range(len(rows))
    ax.plot(xs, rows["native_step_ms"], "o-", label="native", ms=3)
    ax.plot(xs, rows["arm_step_ms"], "s-", label="replay", ms=3)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(rows["scenario"], rotation=90, fontsize=6)
    ax.set_ylabel("median ms per training batch")
    ax.legend()
    fig.tight_layout()
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
        ax_m.text(0.5, 0.5, "no CUDA memory statistics on a CPU", ha="center", transform=ax_m.transAxes)
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    return fig
