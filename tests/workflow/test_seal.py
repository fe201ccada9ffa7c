"""A notebook's own seal (its last cell, ``seal.finish``): a downloaded .ipynb is evidence by itself,
and an edit after the run (the seal, a cell's source) is flagged, as for run folders."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tooling not installed")
pytest.importorskip("nbclient", reason="notebook tooling not installed")

from replaykit.workflow import cli  # noqa: E402 - after the importorskip guards
from replaykit.workflow.evidence import EDITED, OK, UNSEALED, load_notebook  # noqa: E402
from replaykit.workflow.runs import ensure_kernel  # noqa: E402

PARAMS = "# Parameters\nsteps: int = 3  # a help text\nname: str = 'x'"
FP = "{'tree': {'commit': 'a' * 40, 'dirty': False}, 'python': '3.11.0', 'torch': '2.13.0+cpu', 'device': 'cpu'}"


ROOT = Path(__file__).resolve().parents[2]
RECORD = "from replaykit.workflow.bootstrap import record_outputs\nrecord_outputs()"
"""What a notebook's bootstrap cell does last: from the next cell on, outputs are sealed."""


@contextlib.contextmanager
def _this_tree():
    """The kernel imports this checkout's replaykit (not another install of it)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), old]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def execute(folder: Path, *sources: str) -> Path:
    """Run cells in a kernel of this interpreter, as Run all does (stops at an error); save the notebook."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    folder.mkdir(parents=True, exist_ok=True)
    with _this_tree(), contextlib.suppress(CellExecutionError):
        NotebookClient(
            nb, kernel_name=ensure_kernel(), resources={"metadata": {"path": str(folder)}}
        ).execute()
    path = folder / "run.ipynb"
    nbformat.write(nb, str(path))
    return path


def seal_cell(failed: list[str], results: str = "") -> str:
    results = results or "{'counts': {'passed': 2, 'failed': len(failed)}}"
    return (
        f"from replaykit.workflow.seal import finish\nfailed = {failed!r}\n"
        f"finish('run.ipynb', {results}, failed, {FP})\n"
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


@pytest.mark.slow  # two notebooks, a kernel each
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


PARITY = {  # parity.ipynb's results in a kernel without torchvision: resnet18's zoo rows skipped
    "scenarios": 4,
    "passed": 4,
    "failed": [],
    "zoo": {"rows": 4, "verdicts": {"bitwise": 2, "skipped": 2}, "failed": [], "silent": []},
    "whole_step": {"passed": 4, "total": 4},
}


def test_skipped_rows_are_never_counted_as_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from replaykit.workflow.index import index_rows
    from replaykit.workflow.runs import summary_line
    from replaykit.workflow.verdict import result_text, status_text

    summary = {"status": "passed", "reason": None, "results": PARITY}
    text = "10 passed, 2 skipped (scenarios 4/4, zoo 2/2 +2 skipped, whole step 4/4)"
    assert result_text(summary) == text and status_text(summary) == "passed, 2 skipped"
    line = summary_line({**summary, "notebook": "parity.ipynb", "duration_s": 1.0})
    assert line.startswith("passed, 2 skipped | parity.ipynb") and text in line
    cell = {"env": "e", "tree": {"label": "t"}, "notebook": "p.ipynb", "parameters": {}}
    assert index_rows([cell | {"status": "passed", "summary": line, "skipped": 2}])[0][
        "status"
    ] == ("passed, 2 skipped")

    path = execute(tmp_path / "skip", PARAMS, seal_cell([], repr(PARITY)))
    run = load_notebook(path)
    assert run.integrity == OK and run.result() == text
    shown = json.loads(path.read_text())["cells"][-1]["outputs"][0]["data"]["text/markdown"]
    assert "".join(shown).startswith(f"**replaykit verdict: passed, 2 skipped** — {text}")
    assert cli.evidence([str(path)]) == 0 and f"| {text} |" in capsys.readouterr().out


SHOWS = (
    "print('12 passed')\nimport sys\nprint('3 warnings', file=sys.stderr)",
    "from IPython.display import HTML, Image, display\ndisplay(HTML('<td>12 passed</td>'))\n"
    "display(Image(data=b'\\x89PNG\\r\\n\\x1a\\n0000', format='png'))\n'12 of 12'",
)


def _edited(path: Path, cell: int, old: str, new: str, out: int | None = None) -> Path:
    nb = json.loads(path.read_text())
    outs = nb["cells"][cell]["outputs"]
    text = json.dumps(outs if out is None else outs[out])
    assert old in text, (old, text)
    edited = json.loads(text.replace(old, new, 1))
    nb["cells"][cell]["outputs"] = (
        edited if out is None else [*outs[:out], edited, *outs[out + 1 :]]
    )
    copy = path.with_name(f"edit{cell}_{abs(hash((old, new, out)))}.ipynb")
    copy.write_text(json.dumps(nb))
    return copy


def test_every_output_is_sealed_and_an_edited_one_is_flagged(tmp_path: Path) -> None:
    path = execute(tmp_path / "out", PARAMS, RECORD, *SHOWS, seal_cell([]))
    run = load_notebook(path)
    assert run.integrity == OK and run.problems == [], run.problems
    nbformat.write(nbformat.read(str(path), as_version=4), str(tmp_path / "resaved.ipynb"))
    assert load_notebook(tmp_path / "resaved.ipynb").integrity == OK  # a save keeps the digests
    png = json.loads(path.read_text())["cells"][3]["outputs"][1]["data"]["image/png"]
    edits = {
        "seal's text/markdown": (4, "\\u2014 2 passed", "\\u2014 3 passed", 0),
        "seal's text/plain": (4, '"text/plain": ["2 passed"]', '"text/plain": ["3 passed"]', 0),
        "stdout line": (2, "12 passed", "13 passed", None),
        "stderr line": (2, "3 warnings", "0 warnings", None),
        "HTML table": (3, "<td>12 passed", "<td>13 passed", None),
        "image bytes": (3, png[:8], "iVBORw0L", None),
        "execute_result": (3, "12 of 12", "13 of 13", None),
    }
    for what, (cell, old, new, out) in edits.items():
        edited = load_notebook(_edited(path, cell, old, new, out))
        assert edited.integrity == EDITED, what
        assert "EDITED" in edited.problems[0] and "digest" not in edited.problems[0], what
    assert cli.evidence([str(_edited(path, 2, "12 passed", "13 passed"))]) == 1
