"""The parity notebook's plots, on hand-made results: what each draws, and what it says it left out."""

from __future__ import annotations

import math

import pytest
import torch

matplotlib = pytest.importorskip(
    "matplotlib", reason="the notebooks extra (matplotlib) is not installed"
)
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - after the importorskip guard

from replaykit.testing import plots  # noqa: E402
from replaykit.testing.parity.scenario import ArmOutcome, Scenario, ScenarioResult, steady_steps  # noqa: E402
from replaykit.verify.bitwise import TensorDiff  # noqa: E402

STATE = {"param/w": torch.zeros(2), "param/b": torch.zeros(1)}


def result(
    scenario: Scenario,
    arms: dict[str, list[float]],
    diffs: dict[str, list[TensorDiff]] | None = None,
    errors: dict[str, str] | None = None,
) -> ScenarioResult:
    """A result with the given per-step times per arm (native first) and diffs."""
    errors = errors or {}
    outcomes = {
        a: ArmOutcome(a, dict(STATE), None, ms, 0.0, errors.get(a)) for a, ms in arms.items()
    }
    return ScenarioResult(
        scenario, outcomes, {a: [] for a in arms if a != "native"} | (diffs or {})
    )


EQUAL = Scenario(task="detection", accumulation=1)
COPY = Scenario(task="detection", accumulation=2)
POSE = Scenario(task="pose", accumulation=2)
BROKEN = Scenario(task="oriented", accumulation=1)
NATIVE_ONLY = Scenario(task="segmentation", accumulation=1)

STEPS = [50.0, 40.0, 10.0, 10.0, 10.0, 10.0]  # two warm-up steps, then steady


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture
def results() -> list[ScenarioResult]:
    values = TensorDiff("grad/step0/w", "values", max_abs=0.5, max_ulp=12, mismatched=1, numel=2)
    return [
        result(EQUAL, {"native": STEPS, "replay": [90.0, 90.0, 5.0, 5.0, 5.0, 5.0]}),
        result(
            COPY,
            {
                "native": STEPS,
                "replay": [90.0, 90.0, 20.0, 20.0, 20.0, 20.0],
                "unsafe:copy_out": STEPS,
            },
            {
                "unsafe:copy_out": [
                    values,
                    TensorDiff("buffer/running_mean", "values", 1.0, 3_000_000, 1, 4),
                ]
            },
        ),
        result(
            POSE,
            {"native": STEPS, "replay": STEPS, "unsafe:copy_out": STEPS},
            {"unsafe:copy_out": [TensorDiff("grad/step1/b", "none_pattern", numel=1)]},
        ),
        result(BROKEN, {"native": STEPS, "replay": []}, errors={"replay": "RuntimeError: boom"}),
        result(NATIVE_ONLY, {"native": STEPS}),
    ]


def test_steady_steps_drop_warm_up_only_when_there_are_steps_to_spare() -> None:
    assert steady_steps(STEPS) == [10.0] * 4
    assert steady_steps([3.0, 2.0, 1.0]) == [3.0, 2.0, 1.0]
    assert steady_steps([]) == []


def test_step_ratios_are_median_ratios_sorted_with_a_per_step_band(results) -> None:
    ratios, left_out = plots.step_ratios(results)
    assert [s.scenario for s in ratios] == [EQUAL.name, POSE.name, COPY.name]  # sorted: 0.5, 1, 2
    assert [s.ratio for s in ratios] == [0.5, 1.0, 2.0]
    assert all(s.low <= s.ratio <= s.high and s.steps == 4 for s in ratios)
    assert dict(left_out) == {
        "scenarios without a replay arm": [NATIVE_ONLY.name],
        "scenarios where an arm raised (its times are of a run that stopped)": [BROKEN.name],
    }


def test_step_ratio_band_is_p10_p90_of_the_per_step_ratios() -> None:
    r = result(
        EQUAL,
        {"native": [1.0] * 2 + [10.0] * 11, "replay": [1.0] * 2 + [float(k) for k in range(1, 12)]},
    )
    (s,), _ = plots.step_ratios([r])
    assert (
        s.ratio == pytest.approx(0.6)
        and s.low == pytest.approx(0.2)
        and s.high == pytest.approx(1.0)
    )


def test_ratio_chart_has_one_sorted_bar_per_scenario_a_line_at_one_and_a_note(
    results, capsys
) -> None:
    fig = plots.plot_step_ratios(results)
    ax = fig.axes[0]
    assert [p.get_width() for p in ax.patches] == [0.5, 1.0, 2.0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"{EQUAL.name}  0.50", f"{POSE.name}  1.00", f"{COPY.name}  2.00"]
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.lines)  # the 1.0 line
    assert "p10-p90 of per-step ratios" in ax.get_xlabel()
    printed = capsys.readouterr().out
    assert BROKEN.name in printed and NATIVE_ONLY.name in printed
    note = " ".join(t.get_text() for t in fig.texts)
    assert "left out: 1 scenarios without a replay arm" in note and BROKEN.name in note


def test_ratio_chart_without_anything_to_leave_out_says_nothing(results, capsys) -> None:
    fig = plots.plot_step_ratios(results[:3])
    assert len(fig.axes[0].patches) == 3 and not fig.texts
    assert capsys.readouterr().out == ""


def test_ulp_cells_take_the_max_over_every_tensor_and_count_what_ulps_do_not_measure(
    results,
) -> None:
    scenarios, arms, cells = plots.ulp_cells(results)
    assert scenarios == [r.scenario.name for r in results]
    assert arms == ["replay", "unsafe:copy_out"]
    copy = cells[COPY.name, "unsafe:copy_out"]
    assert copy.max_ulp == 3_000_000 and copy.unmeasured == 0 and copy.label == "3e6"
    pose = cells[POSE.name, "unsafe:copy_out"]
    assert pose.max_ulp == 0 and pose.unmeasured == 1 and pose.label == "≠" and not pose.equal
    assert cells[EQUAL.name, "replay"].equal and cells[EQUAL.name, "replay"].label == "0"
    assert cells[BROKEN.name, "replay"].label == "error" and not cells[BROKEN.name, "replay"].ok
    assert (EQUAL.name, "unsafe:copy_out") not in cells  # not run: the protection is not exercised
    assert (NATIVE_ONLY.name, "replay") not in cells


def test_heatmap_has_every_scenario_as_a_row_even_when_equal(results, capsys) -> None:
    fig = plots.plot_ulp_heatmap(results)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [r.scenario.name for r in results]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["replay", "unsafe:copy_out"]
    texts = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts
    }
    assert texts[0, 0] == "0" and texts[0, 1] == "–"  # equal, and an arm not run
    assert texts[1, 1] == "3e6" and texts[2, 1] == "≠" and texts[3, 0] == "error"
    assert texts[4, 0] == "–" and texts[4, 1] == "–"  # a scenario with no arm still has its row
    assert fig.axes[1].get_yscale() == "log"  # the colour bar
    image = ax.get_images()[0].get_array()
    assert image.shape[:2] == (5, 2)
    equal_rgba = tuple(image[0, 0])
    assert equal_rgba != tuple(image[1, 1]) and equal_rgba != tuple(
        image[0, 1]
    )  # 0 is drawn distinctly
    red = [p for p in ax.patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(red) == 1  # the raised replay arm is the one failed case
    assert capsys.readouterr().out == ""  # nothing left out


def test_diff_plot_says_which_scenarios_and_tensors_it_does_not_draw(results, capsys) -> None:
    fig = plots.plot_diffs(results, max_panels=1)
    assert [ax.get_title() for ax in fig.axes] == [COPY.name]
    printed = capsys.readouterr().out
    assert f"differing scenarios beyond the first 1: {POSE.name}, {BROKEN.name}" in printed
    assert f"every arm is bitwise equal: {EQUAL.name}, {NATIVE_ONLY.name}" in printed
    assert f"{COPY.name} [unsafe:copy_out]: 1" in printed  # the buffer: not a parameter
    assert "left out" in " ".join(t.get_text() for t in fig.texts)


def test_diff_plot_draws_none_pattern_mismatches_at_the_top(results) -> None:
    fig = plots.plot_diffs([results[2]])
    ys = [y for c in fig.axes[0].collections for _, y in c.get_offsets()]
    assert 1e6 in ys and math.inf not in ys
