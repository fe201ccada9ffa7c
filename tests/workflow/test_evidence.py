"""evidence.py: the log table from run folders (made here, and one real run), failures, links, integrity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tooling not installed")

from replaykit.workflow import cli  # noqa: E402 - after the importorskip guard
from replaykit.workflow.evidence import (  # noqa: E402
    EDITED,
    MISSING,
    OK,
    UNSEALED,
    collect,
    counts_text,
    result_text,
    runtime_text,
)
from replaykit.workflow.seal import seal  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BB, CF = "bb3c0b8" + "1" * 33, "3cf592d" + "2" * 33
SEEDS = """\
| Tree | Runtime | Result |
|---|---|---|
| bb3c0b8 (copy-out fix) | Python 3.11 / torch 2.9.1+cu129 | 27 passed |
| 3cf592d (before copy-out fix) | Python 3.11 / torch 2.9.1+cu129 | 18 failed, 9 passed |"""
JUNIT = """\
<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.test_x.TestA" name="test_b[1]" time="0.1">
<failure message="AssertionError: boom">long text</failure></testcase>
<testcase classname="tests.test_x" name="test_ok" time="0.1"/>
</testsuite></testsuites>
"""


def fake_run(
    parent: Path,
    name: str,
    *,
    commit: str | None = BB,
    counts: dict[str, int] | None = None,
    status: str = "passed",
    reason: str | None = None,
    results: dict[str, Any] | None = None,
    fingerprint: dict[str, Any] | None = None,
    notebook: str = "verify.ipynb",
    sealed: bool = True,
) -> Path:
    """A folder as replaykit.runs.run_notebook leaves it: the executed notebook (sealed, unless
    ``sealed`` is False: a run from before seals) and summary.json."""
    folder = parent / name
    folder.mkdir(parents=True)
    nb = nbformat.v4.new_notebook(metadata={"run": name})
    nbformat.write(nb, folder / notebook)
    results = results if results is not None else {"counts": counts or {"passed": 1}}
    fp = fingerprint or {
        "python": "3.11.9",
        "torch": "2.9.1+cu129",
        "device": "cpu",
        "gpu": None,
        "tree": {"commit": commit, "dirty": False},
    }
    summary = {
        "schema": 1,
        "notebook": notebook,
        "output": notebook,
        "sha256": hashlib.sha256((folder / notebook).read_bytes()).hexdigest(),
        "status": status,
        "reason": reason,
        "failed_cell": None,
        "errors": [],
        "fingerprint": fp,
        "results": results,
        "counts": results.get("counts"),
        "duration_s": 1.0,
    }
    if sealed:
        seal(folder / notebook, summary)
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def index(folder: Path, cells: list[dict[str, Any]]) -> Path:
    path = folder / "index.json"
    path.write_text(json.dumps({"schema": 1, "kind": "batch", "cells": cells}))
    return path


def cell(run: Path | None, label: str, commit: str | None, **extra: Any) -> dict[str, Any]:
    """A batch index record (``status`` as the run ended, unless ``extra`` says otherwise)."""
    return {
        "env": "main",
        "tree": {"label": label, "commit": commit},
        "notebook": "verify.ipynb",
        "run_dir": run.name if run else None,
        "status": "passed",
        **extra,
    }


def test_the_seeds_table_from_a_batch(tmp_path: Path) -> None:
    batch = tmp_path / "runs" / "batch_x"
    a = fake_run(
        batch, "a", commit=BB, counts={"passed": 27, "failed": 0, "error": 0, "skipped": 0}
    )
    b = fake_run(
        batch,
        "b",
        commit=CF,
        counts={"passed": 9, "failed": 18, "error": 0, "skipped": 0},
        status="failed",
    )
    path = index(
        batch, [cell(a, "copy-out fix", BB), cell(b, "before copy-out fix", CF, status="failed")]
    )
    ev = collect(batches=[path])
    assert ev.table() == SEEDS
    assert [r.integrity for r in ev.runs] == [OK, OK] and ev.warnings == [] and ev.edited == []
    # The same runs found by scanning the runs folder (through the index), and not twice.
    assert collect(runs=[tmp_path / "runs"], batches=[batch]).table() == SEEDS


def test_texts() -> None:
    assert (
        counts_text({"passed": 9, "failed": 18, "error": 0, "skipped": 0}) == "18 failed, 9 passed"
    )
    assert counts_text({"error": 2, "skipped": 1, "passed": 3}) == "3 passed, 1 skipped, 2 errors"
    assert counts_text({"passed": 0}) == "no tests ran"
    assert counts_text({"passed": 0, "skipped": 71}) == "no tests ran (71 skipped)"  # never a pass
    fp = {
        "python": "3.13.1",
        "torch": "2.11.0+cu130",
        "device": "NVIDIA H200",
        "gpu": "NVIDIA H200",
    }
    assert runtime_text(fp) == "Python 3.13 / torch 2.11.0+cu130 / NVIDIA H200"
    assert (
        runtime_text({"python": "3.11.7", "torch": None, "device": "cpu"})
        == "Python 3.11 / torch none"
    )

    def text(**summary: Any) -> str:
        return result_text({"status": "passed", "reason": None, **summary})

    same = {"r1": {"passed": 3}, "r2": {"passed": 3}, "r3": {"passed": 3}, "alone": {}}
    assert text(results={"counts": {"passed": 9}, "counts_per_run": same}) == "3 passed (×3)"
    differ = {"r1": {"passed": 2, "failed": 1}, "r2": {"passed": 3}}
    flaky = {"counts": {"passed": 5, "failed": 1}, "counts_per_run": differ, "flaky_ids": ["t::a"]}
    assert text(status="failed", results=flaky) == "r1: 1 failed, 2 passed; r2: 3 passed, 1 flaky"
    parity = {"passed": 94, "failed": ["a", "b"], "scenarios": 96, "line": "94/96 scenarios passed"}
    assert (
        text(status="failed", reason="exception", results=parity)
        == "2 failed, 94 passed (scenarios 94/96)"
    )
    # every part of a notebook's results counts: parity's zoo rows and whole-step scenarios too
    zoo_only = {"passed": 0, "failed": [], "scenarios": 0, "zoo": {"rows": 3, "failed": []}}
    assert text(results=zoo_only) == "3 passed (scenarios 0/0, zoo 3/3)"
    demo = {
        "passed": 2,
        "failed": [],
        "scenarios": 2,
        "zoo": {"rows": 4, "failed": ["resnet18 32 acc2"]},
        "whole_step": {"passed": 1, "total": 2},
    }
    assert text(status="failed", reason="exception", results=demo) == (
        "2 failed, 6 passed (scenarios 2/2, zoo 3/4, whole step 1/2)"
    )
    hazards = {"runs": 40, "failures": 1, "unsafe_runs": 10, "unsafe_diverged": 9, "line": "..."}
    assert (
        text(status="failed", reason="exception", results=hazards)
        == "1 failed, 49 passed (pattern runs 49/50)"
    )
    rows = [
        {"arm": "eager"},
        {"arm": "replaykit", "equals_eager": True},
        {"arm": "replaykit+check", "equals_eager": False},
    ]
    bench = {
        "replaykit_equal": False,
        "rows": rows,
        "whole_step": {
            "step_equal": True,
            "rows": [
                {"arm": "replaykit step", "equals_eager": True},
                {"arm": "raw step graph", "equals_eager": True},
            ],
        },
    }
    assert (
        text(status="failed", reason="exception", results=bench)
        == "1 failed, 2 passed (sizes 1/2, whole step 1/1)"
    )
    assert text(results={"line": "replaykit 1.9x eager"}) == "replaykit 1.9x eager"
    assert text(status="error", reason="kernel_died", results=None) == "error (kernel_died)"
    assert text(status="error", reason="kernel_died", results={"counts": {"passed": 2}}) == (
        "2 passed (error: kernel_died)"
    )
    skipped = {"counts": {"passed": 0, "failed": 0, "skipped": 71}, "outcome": "no tests ran"}
    assert text(status="failed", reason="exception", results=skipped) == "no tests ran (71 skipped)"
    broken = {"counts": {"passed": 0}, "run_errors": ["r1: pytest exit 2 (1 error in 0.1s)"]}
    assert text(status="failed", reason="exception", results=broken) == (
        "no tests ran (run error: r1: pytest exit 2 (1 error in 0.1s))"
    )


def test_failures_links_and_unrun_cells(tmp_path: Path) -> None:
    batch = tmp_path / "runs" / "batch_y"
    results = {
        "counts": {"passed": 1, "failed": 1},
        "failing_ids": ["tests/test_x.py::TestA::test_b[1]"],
        "verdicts": {"tests/test_x.py::TestA::test_b[1]": "stable fail"},
        "runs": [{"junit": "junit_r1.xml"}],
    }
    run = fake_run(
        batch, "20261129T0801Z_cuda", results=results, status="failed", reason="exception"
    )
    (run / "pytest").mkdir()
    (run / "pytest" / "junit_r1.xml").write_text(JUNIT)
    gpu = {
        "python": "3.13.1",
        "torch": "2.11.0+cu130",
        "device": "NVIDIA H200",
        "gpu": "NVIDIA H200",
        "tree": {"commit": CF, "dirty": True},
    }
    other = fake_run(batch, "20261129T0802Z_cuda", fingerprint=gpu)
    unrun = cell(None, "old", CF, env="torch2.9", status="error", reason="env build failed")
    path = index(batch, [cell(run, "main", BB, status="failed"), cell(other, CF[:7], CF), unrun])
    out = tmp_path / "log"
    md = collect(batches=[path]).markdown(relative_to=out)
    table = md.split("\n\n")[0].splitlines()
    # two environments in the batch: an Environment column tells their rows apart
    assert table[0] == "| Tree | Environment | Runtime | Result |"
    assert (
        table[2]
        == "| bb3c0b8 (main) | main | Python 3.11 / torch 2.9.1+cu129 | 1 failed, 1 passed |"
    )
    assert (
        table[3]
        == "| 3cf592d-dirty | main | Python 3.13 / torch 2.11.0+cu130 / NVIDIA H200 | 1 passed |"
    )
    assert table[4] == "| 3cf592d (old) | torch2.9 | torch2.9 (not run) | error: env build failed |"
    assert "  - `tests/test_x.py::TestA::test_b[1]` stable fail: AssertionError: boom" in md
    link = "[20261129T0801Z_cuda/verify.ipynb](../runs/batch_y/20261129T0801Z_cuda/verify.ipynb)"
    assert f"- bb3c0b8 (main) · Python 3.11 / torch 2.9.1+cu129: {link}" in md
    assert "Warnings" not in md


def test_a_collection_error_shows_its_exception(tmp_path: Path) -> None:
    """pytest's junit message for any collection error is "collection failure": the row says which."""
    junit = JUNIT.replace(
        '<testcase classname="tests.test_x" name="test_ok" time="0.1"/>',
        '<testcase classname="" name="tests.lightning.test_y"><error message="collection failure">'
        "ImportError while importing test module.\nE   ModuleNotFoundError: No module named 'lightning'</error></testcase>",
    )
    results = {
        "counts": {"passed": 0, "failed": 1, "error": 1},
        "runs": [{"junit": "junit_r1.xml"}],
        "failing_ids": ["tests/test_x.py::TestA::test_b[1]", "tests/lightning/test_y.py"],
    }
    run = fake_run(tmp_path / "runs", "r", results=results, status="failed", reason="exception")
    (run / "pytest").mkdir()
    (run / "pytest" / "junit_r1.xml").write_text(junit)
    md = collect(folders=[run]).markdown()
    assert (
        "  - `tests/lightning/test_y.py` failed: ModuleNotFoundError: No module named 'lightning'"
        in md
    )


def test_a_run_that_saved_no_notebook_is_not_an_edit(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "dead", status="error", reason="runner_error", results={})
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary | {"sha256": None}))
    (run / "verify.ipynb").unlink()
    ev = collect(folders=[run])
    assert ev.runs[0].integrity == "no hash" and ev.edited == []
    assert ev.runs[0].result() == "error (runner_error)" and "saved no notebook" in ev.warnings[0]
    assert "Executed notebooks" not in ev.markdown()


def test_an_edited_notebook_is_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("papermill", reason="papermill tooling not installed")
    import nbformat

    from replaykit.workflow.runs import run_notebook

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell('run_dir = ""', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("print('real run')"),
    ]
    nbformat.write(nb, tmp_path / "real.ipynb")
    runs = tmp_path / "runs"
    real = run_notebook(tmp_path / "real.ipynb", {}, runs_dir=runs, progress=False).run_dir
    fake = fake_run(runs, "zz_fake")
    (runs / "zz_legacy").mkdir()
    (runs / "zz_legacy" / "summary.json").write_text(
        json.dumps({"tree": {"commit": BB}})
    )  # hand-written

    ev = collect(runs=[runs])
    assert [r.folder for r in ev.runs] == [real, fake] and ev.skipped == [runs / "zz_legacy"]
    assert [r.integrity for r in ev.runs] == [OK, OK]
    assert ev.runs[0].result() == "passed"  # no counts: the status

    assert cli.evidence(["--runs", str(runs)]) == 0
    text = real / "real.ipynb"
    text.write_text(text.read_text().replace("real run", "a better run"))  # edited after the run
    (fake / "verify.ipynb").unlink()
    ev = collect(runs=[runs])
    assert [r.integrity for r in ev.runs] == [EDITED, MISSING] and len(ev.edited) == 2
    assert ev.runs[0].result() == "passed **EDITED**"
    assert any("EDITED after the run" in w and "real.ipynb" in w for w in ev.warnings)
    assert any("missing" in w for w in ev.warnings)
    out = tmp_path / "notes" / "entry.md"
    assert cli.evidence(["--runs", str(runs), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert out.read_text() in captured.out and "Warnings:" in out.read_text()
    assert "(../runs/" in out.read_text()  # links relative to the output file
    assert "2 notebook(s) edited after the run or missing" in captured.err

    assert cli.evidence([str(tmp_path / "nowhere")]) == 2
    assert cli.evidence(["--batch", str(tmp_path)]) == 2
    assert "no such batch index" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("recorded", "claimed", "truth"),
    [
        ({"passed": 27}, {"failed": 3, "passed": 24}, "27 passed"),
        ({"failed": 3, "passed": 24}, {"passed": 27}, "3 failed, 24 passed"),
    ],
    ids=["pass-edited-to-fail", "fail-edited-to-pass"],
)
def test_an_edited_summary_is_flagged_and_the_result_is_the_notebooks(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    recorded: dict,
    claimed: dict,
    truth: str,
) -> None:
    """summary.json alone edited (the notebook untouched, so its sha256 still matches): the seal catches it."""
    status = "passed" if "failed" not in recorded else "failed"
    run = fake_run(tmp_path / "runs", "r", results={"counts": recorded}, status=status)
    assert collect(folders=[run]).runs[0].integrity == OK
    summary = json.loads((run / "summary.json").read_text())
    summary["results"]["counts"] = summary["counts"] = claimed
    summary["status"] = "failed" if "failed" in claimed else "passed"
    (run / "summary.json").write_text(json.dumps(summary))
    ev = collect(folders=[run])
    assert ev.runs[0].integrity == EDITED and ev.edited == ev.runs
    assert (
        ev.runs[0].result() == f"{truth} **EDITED**"
    )  # the notebook's verdict, not the edited one
    assert any("summary.json: EDITED after the run" in w and "counts" in w for w in ev.warnings)
    assert cli.evidence([str(run)]) == 1
    assert "edited after the run" in capsys.readouterr().err


def test_a_run_from_before_seals_is_marked_unsealed(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "old", sealed=False)
    ev = collect(folders=[run])
    assert ev.runs[0].integrity == UNSEALED and ev.edited == []  # not an edit, but said
    assert ev.runs[0].result() == "1 passed" and "no seal" in ev.warnings[0]


def test_a_failed_cell_cannot_read_as_passed(tmp_path: Path) -> None:
    """Both files rewritten consistently (the seal holds) still cannot call a failed notebook passed."""
    run = fake_run(tmp_path, "r", status="passed")
    nb = nbformat.read(run / "verify.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("1/0", metadata={"papermill": {"status": "failed"}}))
    nbformat.write(nb, run / "verify.ipynb")
    summary = json.loads((run / "summary.json").read_text())
    seal(run / "verify.ipynb", summary)
    (run / "summary.json").write_text(json.dumps(summary))
    ev = collect(folders=[run])
    assert (
        ev.runs[0].integrity == EDITED
        and "a cell failed, but the run is recorded as passed" in ev.warnings[0]
    )
