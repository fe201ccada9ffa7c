"""The commands: one dispatcher (`replaykit-workflow`, `python -m replaykit.workflow`), scripts/ as shims, the wheel."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from replaykit.workflow import archive, cli
from replaykit.workflow.fingerprint import notebook_path

ROOT = Path(__file__).resolve().parents[2]
SHIMS = {
    "pack.py": "pack",
    "run_notebook.py": "run",
    "batch.py": "batch",
    "verify_tree.py": "verify",
    "evidence.py": "evidence",
    "bisect_commits.py": "bisect",
}


def test_the_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(cli.COMMANDS) == set(SHIMS.values())
    assert cli.main(["--help"]) == 0 and "bisect" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["nope"]) == 2 and "unknown command" in capsys.readouterr().err
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: replaykit-workflow {name} ")


@pytest.mark.parametrize("script", sorted(SHIMS))
def test_scripts_are_shims(script: str) -> None:
    text = (ROOT / "scripts" / script).read_text()
    code = [
        line for line in text.splitlines() if line.strip() and not line.startswith(("#", '"""'))
    ]
    assert len(code) <= 10, f"{script} is more than a shim"
    assert f'"{SHIMS[script]}"' in text or "archive.main(" in text


HARNESS = {
    "bench_replay.py",
    "call_walk.py",
    "code_guard_vs.py",
    "core_shape.py",
    "demo.py",
    "guard_cost.py",
    "overhead_vs.py",
    "parity_matrix.py",
}  # entry points over replaykit.testing and runs (core_shape, call_walk: the core's size and tangle;
# overhead_vs, code_guard_vs: the replay path's host time, the code guard's key, against an older commit;
# guard_cost: the guards' per-call cost docs/limits quotes)


def test_scripts_holds_the_shims_and_the_harness_entry_points_only() -> None:
    """No hidden one-off script (a device run's commands with one machine's paths) hides in scripts/."""
    files = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()}
    assert files == set(SHIMS) | HARNESS
    for name in files:
        assert not re.search(
            r"(?<![\w.])/(tmp|home|work|root|mnt|content)/", (ROOT / "scripts" / name).read_text()
        ), name


def test_a_shim_runs_the_command() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "verify_tree.py"), "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0 and "usage: replaykit-workflow verify" in out.stdout


def test_a_bare_notebook_name_is_the_workflows_own() -> None:
    assert (
        cli.notebook_arg("verify")
        == cli.notebook_arg("verify.ipynb")
        == str(ROOT / "notebooks" / "verify.ipynb")
    )
    assert notebook_path("parity.ipynb") == ROOT / "notebooks" / "parity.ipynb"
    assert cli.notebook_arg("nb/x.ipynb") == "nb/x.ipynb"
    with pytest.raises(FileNotFoundError):
        notebook_path("nope.ipynb")


@pytest.mark.slow
def test_the_wheel_runs_the_workflow_without_a_checkout(tmp_path: Path) -> None:
    """The wheel ships the notebooks and the command; Requires-Dist is torch alone outside extras."""
    tree = archive.unpack(archive.pack(ROOT, tmp_path / "src.tar.gz").path, tmp_path / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(tree),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp_path / "dist").glob("replaykit-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(info).decode()
        entry_points = zf.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert {
        f"replaykit/workflow/notebooks/{n}.ipynb" for n in ("parity", "verify", "benchmark")
    } <= names
    assert {
        "replaykit/workflow/archive.py",
        "replaykit/workflow/__main__.py",
        "replaykit/testing/tasks/__init__.py",
    } <= names
    assert not {n for n in names if n.startswith(("tests/", "scripts/", "notebooks/"))}
    requires = [
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert [r for r in requires if "extra ==" not in r] == ["torch>=2.4"]
    assert "replaykit-workflow = replaykit.workflow.cli:main" in entry_points

    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    probe = (
        "from replaykit.workflow.fingerprint import notebook_path, source_tree, tree_info\n"
        "assert source_tree() is None and tree_info()['source'] == 'installed'\n"
        "print(notebook_path('verify.ipynb'))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    assert (
        Path(found.stdout.strip()) == site / "replaykit" / "workflow" / "notebooks" / "verify.ipynb"
    )
    verify = subprocess.run(
        [sys.executable, "-m", "replaykit.workflow", "verify", "--out", str(tmp_path / "v")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 2 and verify.stderr.startswith("error: needs a source tree:"), (
        verify.stderr
    )


def _one_line_refusal(capsys: pytest.CaptureFixture[str], code: int, *words: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_bad_input_is_refused_in_one_line_with_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    parity = str(ROOT / "notebooks" / "parity.ipynb")
    code = cli.main(["evidence", parity])  # a notebook that never ran is not evidence
    _one_line_refusal(capsys, code, "never executed")
    code = cli.main(["run", str(ROOT / "notebooks" / "verify.ipynb"), "-p", "tree", "gone.tar.gz"])
    _one_line_refusal(capsys, code, "gone.tar.gz", "no such archive or folder")
    code = cli.main(["batch", "--env", "x=/nonexistent/python", "--notebook", parity])
    _one_line_refusal(capsys, code, "environment x", "/nonexistent/python")
    code = cli.main(["run", str(tmp_path / "missing.ipynb")])
    _one_line_refusal(capsys, code, "notebook not found")
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, no batch folder


def test_a_core_install_is_told_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(
        sys.modules, "papermill", None
    )  # not installed, as in `pip install replaykit`
    code = cli.main(["run", str(ROOT / "notebooks" / "parity.ipynb")])
    _one_line_refusal(capsys, code, "papermill", "pip install 'replaykit[workflow]'")
    code = cli.main(["batch", "--notebook", str(ROOT / "notebooks" / "parity.ipynb")])
    _one_line_refusal(capsys, code, "papermill", "pip install 'replaykit[workflow]'")


def test_ctrl_c_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from replaykit.workflow import evidence

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(evidence, "collect", interrupted)
    assert cli.main(["evidence", str(ROOT / "tests")]) == 130
    err = capsys.readouterr().err
    assert err == "replaykit-workflow evidence: interrupted\n"


def test_ctrl_c_during_a_run_keeps_the_partial_notebook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("papermill")
    cells = [
        nbformat.v4.new_code_cell('run_dir = ""', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("print('before')"),
        # the user's Ctrl-C reaches the runner (the kernel runs in a session of its own)
        nbformat.v4.new_code_cell(
            "import os, signal, time\nos.kill(os.getppid(), signal.SIGINT)\ntime.sleep(5)"
        ),
        nbformat.v4.new_code_cell("print('never')"),
    ]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(tmp_path / "stop.ipynb"))
    monkeypatch.chdir(tmp_path)
    # Python's own Ctrl-C handler, as in a user's shell: a test run before this one in the same
    # worker process may have left another installed (the signal then never interrupted the run)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cli.main(["run", "stop.ipynb", "--no-progress"])
    finally:
        signal.signal(signal.SIGINT, before)
    assert code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: the partial notebook is saved: ")
    saved = nbformat.read(err[0].rsplit(": ", 1)[1], as_version=4)
    assert saved.cells[2].outputs[0]["text"] == "before\n"  # cells[1]: injected parameters
    assert saved.cells[4].metadata["papermill"]["status"] == "pending"


def test_a_run_folder_is_named_after_the_tree_under_test(tmp_path: Path) -> None:
    """``run -p tree ARCHIVE`` tests the archive: its folder names the archive's commit, not the
    commit of the checkout the runner happens to sit in (a GPU host's stale copy)."""
    from replaykit.workflow.cli import tree_under_test

    archive = tmp_path / "replaykit-abc1234.tar.gz"
    archive.write_bytes(b"")
    assert tree_under_test(None, {"tree": str(archive)}) == archive
    assert tree_under_test(tmp_path, {"tree": str(archive)}) == tmp_path  # --tree wins
    assert tree_under_test(None, {"tree": "https://example.org/r.git@main"}) is None
    assert tree_under_test(None, {}) is None
