"""The notebook runner: saved notebooks and summaries for passing, failing and stuck notebooks."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="papermill tooling not installed")
pytest.importorskip("papermill", reason="papermill tooling not installed")

from replaykit.workflow import cli  # noqa: E402
from replaykit.workflow.runs import (  # noqa: E402 - after the importorskip guards
    SUMMARY_FILE,
    cli_parameters,
    ensure_kernel,
    kernel_executable,
    run_notebook,
    summary_line,
)

ROOT = Path(__file__).resolve().parents[2]
RUN_DIR = re.compile(r"^\d{8}T\d{6}Z_[A-Za-z0-9.-]+_torch[A-Za-z0-9.-]+_[A-Za-z0-9.-]+$")

WRITE_RESULTS = """\
import json, pathlib, sys
pathlib.Path(run_dir, "results.json").write_text(json.dumps(
    {"counts": {"passed": x, "failed": 0}, "executable": sys.executable}))
pathlib.Path(run_dir, "fingerprint.json").write_text(json.dumps({"device": "from-kernel"}))
"""


def make_notebook(path: Path, *cells: str, params: str | None = "x = 1\nrun_dir = None") -> Path:
    """A notebook whose cell 0 is the ``parameters`` cell (unless ``params`` is None)."""
    nb = nbformat.v4.new_notebook()
    if params is not None:
        nb.cells.append(nbformat.v4.new_code_cell(params, metadata={"tags": ["parameters"]}))
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)
    return path


def saved_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def test_kernel_is_this_interpreter() -> None:
    assert kernel_executable(ensure_kernel()) == sys.executable


def test_missing_notebook(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.ipynb"):
        run_notebook(tmp_path / "nope.ipynb", {}, runs_dir=tmp_path / "runs")


def test_no_parameters_cell(tmp_path: Path) -> None:
    nb = make_notebook(tmp_path / "bare.ipynb", "x = 1", params=None)
    with pytest.raises(ValueError, match="parameters"):
        run_notebook(nb, {"x": 2}, runs_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_bad_parameters(tmp_path: Path) -> None:
    nb = make_notebook(tmp_path / "p.ipynb")
    with pytest.raises(ValueError, match="run_dir"):
        run_notebook(nb, {"run_dir": "x"}, runs_dir=tmp_path / "runs")
    with pytest.raises(TypeError, match="x"):
        run_notebook(nb, {"x": object()}, runs_dir=tmp_path / "runs")


def test_cli_parameters(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("tasks: [detect, pose]\nsteps: 2\n")
    params = cli_parameters(
        [["steps", "3"], ["lr", "0.5"], ["amp", "True"], ["none", "None"], ["name", "cuda"]],
        [["tag", "007"]],
        [str(tmp_path / "p.yaml"), '{"precisions": ["fp32"]}'],
    )
    assert params == {
        "tasks": ["detect", "pose"],
        "steps": 3,
        "precisions": ["fp32"],
        "lr": 0.5,
        "amp": True,
        "none": None,
        "name": "cuda",
        "tag": "007",
    }
    with pytest.raises(ValueError, match="mapping"):
        cli_parameters(yamls=["[1, 2]"])


@pytest.mark.slow
def test_passing_notebook(tmp_path: Path) -> None:
    nb = make_notebook(tmp_path / "ok.ipynb", WRITE_RESULTS, "print('done')")
    nb = make_notebook(
        tmp_path / "ok.ipynb",
        WRITE_RESULTS,
        "print('done')",
        params="x = 1\nwhere = ''\nrun_dir = None",
    )
    result = run_notebook(
        nb, {"x": 7, "where": tmp_path}, runs_dir=tmp_path / "runs", progress=False
    )
    s = result.summary
    assert (
        result.ok and s["status"] == "passed" and s["reason"] is None and s["failed_cell"] is None
    )
    assert RUN_DIR.match(result.run_dir.name), result.run_dir.name
    assert result.run_dir.parent == tmp_path / "runs"
    assert result.notebook == result.run_dir / "ok.ipynb"
    assert s["sha256"] == hashlib.sha256(result.notebook.read_bytes()).hexdigest()
    assert saved_summary(result.run_dir) == json.loads(json.dumps(s))
    assert s["parameters"] == {
        "x": 7,
        "where": str(tmp_path),
        "run_dir": str(result.run_dir.resolve()),
    }
    assert s["results"]["counts"] == s["counts"] == {"passed": 7, "failed": 0}
    assert s["results"]["executable"] == sys.executable  # the kernel ran this interpreter
    assert s["fingerprint"] == {"device": "from-kernel"} and s["fingerprint_source"] == "notebook"
    assert s["runner_fingerprint"]["executable"] == sys.executable
    assert s["kernel_executable"] == sys.executable
    assert [c["status"] for c in s["cells"]] == ["completed"] * 4
    assert [c["source_index"] for c in s["cells"]] == [0, None, 1, 2]
    assert all(isinstance(c["duration"], float) for c in s["cells"])
    executed = nbformat.read(result.notebook, as_version=4)
    assert "x = 7" in executed.cells[1].source
    assert executed.cells[1].metadata.tags == ["injected-parameters"]
    assert summary_line(s).startswith("passed | ok.ipynb | counts passed=7 failed=0 | ")


@pytest.mark.slow
def test_failing_notebook_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nb = make_notebook(
        tmp_path / "bad.ipynb", "y = x + 1", "raise ValueError(f'boom {y}')", "z = 3"
    )
    argv = [str(nb), "-p", "x", "4", "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    assert cli.run(argv) == 1
    out = capsys.readouterr().out.splitlines()
    run_dir = Path(out[0])
    assert out[1].startswith("failed | bad.ipynb | cell ")
    s = saved_summary(run_dir)
    assert (s["status"], s["reason"]) == ("failed", "exception")
    cell = s["failed_cell"]
    assert (cell["source_index"], cell["ename"], cell["evalue"]) == (2, "ValueError", "boom 5")
    assert cell["papermill"]["status"] == "failed" and cell["papermill"]["exception"] is True
    executed = nbformat.read(run_dir / "bad.ipynb", as_version=4)
    assert s["sha256"] == hashlib.sha256((run_dir / "bad.ipynb").read_bytes()).hexdigest()
    failed = executed.cells[cell["index"]]
    assert failed.outputs[0].ename == "ValueError"
    assert [c["status"] for c in s["cells"]][-2:] == ["failed", "pending"]


@pytest.mark.slow
def test_cell_timeout(tmp_path: Path) -> None:
    nb = make_notebook(tmp_path / "slow.ipynb", "import time\ntime.sleep(30)", "z = 3")
    result = run_notebook(nb, {}, runs_dir=tmp_path / "runs", cell_timeout=1, progress=False)
    s = result.summary
    assert not result.ok and (s["status"], s["reason"]) == ("failed", "timeout")
    assert s["duration_s"] < 20
    cell = s["failed_cell"]
    assert cell["source_index"] == 1 and cell["ename"] == "CellTimeoutError"
    assert "timed out after 1 s" in cell["evalue"]
    assert cell["papermill"]["status"] == "failed"  # not the misleading "completed"
    assert [c["status"] for c in s["cells"]][-1] == "pending"
    executed = nbformat.read(result.notebook, as_version=4)
    texts = [o.get("text", "") for o in executed.cells[cell["index"]].outputs]
    assert any("timed out" in t for t in texts)
    assert s["sha256"] == hashlib.sha256(result.notebook.read_bytes()).hexdigest()


@pytest.mark.slow
def test_dead_kernel(tmp_path: Path) -> None:
    nb = make_notebook(tmp_path / "die.ipynb", "import os\nos._exit(1)", "z = 3")
    result = run_notebook(nb, {}, runs_dir=tmp_path / "runs", progress=False)
    s = result.summary
    assert (s["status"], s["reason"]) == ("error", "kernel_died")
    assert s["failed_cell"]["source_index"] == 1 and s["failed_cell"]["ename"] == "DeadKernelError"
    # papermill marks the dead cell and the never-run ones "completed"; the runner corrects that
    assert [c["status"] for c in s["cells"]][-2:] == ["failed", "pending"]
    assert result.notebook.is_file()


def test_parameter_of_the_wrong_type_is_refused_before_running(tmp_path: Path) -> None:
    nb = ROOT / "notebooks" / "benchmark.ipynb"
    with pytest.raises(TypeError, match="quick"):
        run_notebook(nb, {"quick": "false"}, runs_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing was written
    assert cli_parameters([("quick", "false")], [], []) == {"quick": False}


def test_unknown_parameter_is_refused_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """papermill only warns about an unknown name and runs the defaults: -p marker "" kept markers="cuda"."""
    nb = ROOT / "notebooks" / "verify.ipynb"
    with pytest.raises(
        ValueError,
        match=r"verify.ipynb declares no parameter 'marker'; it declares: tree, markers, ids",
    ):
        run_notebook(nb, {"marker": ""}, runs_dir=tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs").exists()  # nothing ran
    assert cli.run([str(nb), "-p", "marker", "", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "declares no parameter 'marker'" in capsys.readouterr().err


def test_bad_yaml_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"^-y '\{tasks: \[detect': not valid YAML/JSON \(.* at line 1, column \d+\)$",
    ):
        cli_parameters(yamls=["{tasks: [detect"])


def test_a_missing_yaml_file_is_named_missing(tmp_path: Path) -> None:
    """A file name is valid YAML (a string): without the check it read as 'expected a mapping'."""
    with pytest.raises(ValueError, match=r"^-y '.*params.yaml': no such file$"):
        cli_parameters(yamls=[str(tmp_path / "params.yaml")])
    (tmp_path / "params.yaml").write_text("tasks: [detection]\n")
    assert cli_parameters(yamls=[str(tmp_path / "params.yaml")]) == {"tasks": ["detection"]}
    with pytest.raises(ValueError, match="not a file, and not a YAML/JSON mapping"):
        cli_parameters(yamls=["params"])


def test_summary_line_keeps_both_ends_of_the_error_and_says_where_to_look() -> None:
    evalue = (
        "3 failing test id(s): "
        + ", ".join(f"tests/t.py::test_{i}" for i in range(40))
        + "; run errors: [exit 4]"
    )
    s = {
        "status": "failed",
        "notebook": "verify.ipynb",
        "reason": "exception",
        "duration_s": 1.0,
        "run_dir": "runs/x",
        "output": "verify.ipynb",
        "counts": None,
        "failed_cell": {
            "index": 13,
            "source_index": 13,
            "ename": "AssertionError",
            "evalue": evalue,
        },
    }
    line = summary_line(s)
    assert (
        "\n" not in line
        and "AssertionError: 3 failing test id(s)" in line
        and "run errors: [exit 4]" in line
    )
    assert line.endswith("| see runs/x/verify.ipynb")
    assert summary_line(s | {"status": "passed", "failed_cell": None}).endswith("| 1.0 s")


def test_a_run_folder_is_named_after_the_kernels_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch kernel in another venv (torch 2.12.1 beside a runner on 2.13.0) named its runs after the
    runner's torch; the fingerprint inside was right, the folder name was not."""
    import sys

    from replaykit.workflow import fingerprint as fpmod
    from replaykit.workflow import runs

    runner = {
        "device": "cpu",
        "torch": "2.13.0+cpu",
        "tree": {"commit": "abcdef0123", "dirty": False},
    }
    monkeypatch.setattr(runs, "kernel_executable", lambda name: sys.executable)
    assert runs.folder_fingerprint(runner, "here") is runner  # this interpreter: nothing to ask
    monkeypatch.setattr(runs, "kernel_executable", lambda name: "/elsewhere/bin/python")
    monkeypatch.setattr(runs, "torch_of", lambda python: {"torch": "2.12.1+cu130", "device": "cpu"})
    assert (
        fpmod.fingerprint_slug(runs.folder_fingerprint(runner, "other"))
        == "cpu_torch2.12.1_abcdef0"
    )
    monkeypatch.setattr(
        runs, "torch_of", lambda python: None
    )  # it does not run: the runner's, as before
    assert (
        fpmod.fingerprint_slug(runs.folder_fingerprint(runner, "other"))
        == "cpu_torch2.13.0_abcdef0"
    )
    import torch

    assert fpmod.torch_of(sys.executable)["torch"] == torch.__version__


def test_a_batch_asks_each_kernels_torch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_of imports torch in a subprocess (1-2 s): inside a batch, once per interpreter."""
    from replaykit.workflow import runs

    asked: list[str] = []
    monkeypatch.setattr(runs, "kernel_executable", lambda name: f"/envs/{name}/bin/python")
    monkeypatch.setattr(
        runs,
        "torch_of",
        lambda python: asked.append(python) or {"torch": "2.12.1", "device": "cpu"},
    )
    runner = {"device": "cpu", "torch": "2.13.0", "tree": {}}
    with runs.torch_asked_once():
        for kernel in ("a", "b", "a", "b", "a"):
            assert runs.folder_fingerprint(runner, kernel)["torch"] == "2.12.1"
    assert asked == ["/envs/a/bin/python", "/envs/b/bin/python"]
    runs.folder_fingerprint(runner, "a")  # outside a batch: asked again
    assert asked[-1] == "/envs/a/bin/python" and len(asked) == 3
