"""A notebook's own seal (its last cell, ``seal.finish``): a downloaded .ipynb is evidence by itself,
and an edit after the run (the seal, a cell's source) is flagged, as for run folders."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tooling not installed")
pytest.importorskip("nbclient", reason="notebook tooling not installed")

from replaykit.workflow import cli  # noqa: E402 - after the importorskip guards
from replaykit.workflow.evidence import EDITED, OK, UNSEALED, load_notebook  # noqa: E402
from replaykit.workflow.runs import ensure_kernel  # noqa: E402

PARAMS = "# Parameters\nsteps: int = 3  # a help text\nname: str = 'x'"
FP = "{'tree': {'commit': 'a' * 40, 'dirty': False}, 'python': '3.11.0', 'torch': '2.13.0+cpu', 'device': 'cpu'}"


def execute(folder: Path, *sources: str) -> Path:
    """Run cells in a kernel of this interpreter, as Run all does (stops at an error); save the notebook."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(CellExecutionError):
        NotebookClient(
            nb, kernel_name=ensure_kernel(), resources={"metadata": {"path": str(folder)}}
        ).execute()
    path = folder / "run.ipynb"
    nbformat.write(nb, str(path))
    return path


def seal_cell(failed: list[str]) -> str:
    return (
        f"from replaykit.workflow.seal import finish\nfailed = {failed!r}\n"
        f"finish('run.ipynb', {{'counts': {{'passed': 2, 'failed': len(failed)}}}}, failed, {FP})\n"
        "assert not failed, failed"
    )


def test_a_sealed_notebook_is_evidence_and_edits_are_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = execute(tmp_path / "ok", PARAMS, "x = steps * 2", seal_cell([]))
    run = load_notebook(path)
    assert run.integrity == OK and run.problems == []
    assert run.summary["status"] == "passed" and run.result() == "2 passed"
    assert run.summary["parameters"] == {"steps": 3, "name": "x"} and run.tree() == "aaaaaaa"
    assert (
        cli.evidence([str(path)]) == 0
        and "| aaaaaaa | Python 3.11 / torch 2.13.0+cpu | 2 passed |" in capsys.readouterr().out
    )

    nb = json.loads(path.read_text())
    nb["cells"][1]["source"] = "x = steps * 3"  # a cell changed after it ran
    (tmp_path / "cell.ipynb").write_text(json.dumps(nb))
    run = load_notebook(tmp_path / "cell.ipynb")
    assert run.integrity == EDITED and "cell 1 was EDITED after it ran" in run.problems[0]

    verdict = path.read_text().replace(
        '"status": "passed"', '"status": "failed"', 1
    )  # the seal itself
    (tmp_path / "seal.ipynb").write_text(verdict)
    run = load_notebook(tmp_path / "seal.ipynb")
    assert run.integrity == EDITED and "digest does not match" in run.problems[0]
    assert cli.evidence([str(tmp_path / "seal.ipynb")]) == 1


def test_failures_are_sealed_and_an_unfinished_run_is_never_a_pass(tmp_path: Path) -> None:
    failed = load_notebook(execute(tmp_path / "failed", PARAMS, seal_cell(["case a", "case b"])))
    assert failed.integrity == OK and failed.summary["status"] == "failed"
    assert failed.result() == "2 failed, 2 passed" and [f["id"] for f in failed.failures()] == [
        "case a",
        "case b",
    ]

    stopped = load_notebook(
        execute(tmp_path / "stopped", PARAMS, "raise RuntimeError('no GPU')", seal_cell([]))
    )
    assert stopped.integrity == UNSEALED and stopped.summary["status"] == "failed"
    assert stopped.result() == "failed (exception) **unsealed**"
    assert stopped.failures() == [
        {"id": "cell 1", "status": "exception", "message": "RuntimeError: no GPU"}
    ]
