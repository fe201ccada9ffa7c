"""verify.py: pytest selections on small trees made here, archives, manifests, the CLI, the notebook."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from replaykit.workflow import cli
from replaykit.workflow.fingerprint import MANIFEST_NAME
from replaykit.workflow.verify import (
    Selection,
    node_id,
    pytest_summary_line,
    read_junit,
    resolve_tree,
    run_selection,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "verify.ipynb"

MIX = """\
from pathlib import Path

import pytest

COUNTER = Path(__file__).parent.parent / "flaky.count"


@pytest.fixture
def broken():
    raise RuntimeError("broken fixture")


def test_pass():
    pass


def test_fail():
    assert 1 == 2, "always fails"


def test_flaky():
    n = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(n))
    assert n > 1, "fails on the first run"


def test_skip():
    pytest.skip("not here")


def test_setup_error(broken):
    pass


@pytest.mark.gpuish
@pytest.mark.parametrize("x", [1, 2.5])
def test_marked(x):
    assert x


class TestGroup:
    def test_method(self):
        pass
"""

ORDER = """\
import os


def test_leaves_state():
    os.environ["VERIFY_LEFTOVER"] = "1"


def test_needs_clean_state():
    assert "VERIFY_LEFTOVER" not in os.environ, "state left by another test"
"""

SIMPLE = """\
import pytest


def test_pass():
    pass


def test_fail():
    raise ValueError("boom")


def test_skip():
    pytest.skip("no gpu here")
"""

PYPROJECT = '[tool.pytest.ini_options]\nmarkers = ["gpuish: pretends to need a GPU"]\naddopts = "--strict-markers"\n'

M = "tests/test_mix.py::"
OD = "tests/test_order.py::"


def make_tree(root: Path, tests: dict[str, str]) -> Path:
    """A source tree with pyproject.toml and ``tests/<name>`` files."""
    (root / "tests").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    for name, text in tests.items():
        (root / "tests" / name).write_text(text)
    return root


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(tree: Path, files: dict[str, str] | None) -> None:
    manifest: dict = {"commit": "abc1234", "dirty": False, "sha256": "0" * 64}
    if files is not None:
        manifest["files"] = files
    (tree / MANIFEST_NAME).write_text(json.dumps(manifest))


def pack(tree: Path, archive: Path, top: str | None = "tree") -> Path:
    """``tree`` as a tar archive (gzipped for .tar.gz), under folder ``top`` or at the root."""
    mode = "w:gz" if archive.name.endswith("gz") else "w"
    with tarfile.open(archive, mode) as tar:
        tar.add(tree, arcname=top or ".")
    return archive


@pytest.fixture(autouse=True)
def _fast_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner pytest runs need no installed plugins (nbval's import alone takes a second)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Selection]:
    """Two repeats of the mixed tree, then each failing id alone."""
    root = tmp_path_factory.mktemp("mixed")
    tree = make_tree(root / "tree", {"test_mix.py": MIX, "test_order.py": ORDER})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        yield run_selection(tree, markers=None, repeats=2, out_dir=root / "out", progress=False)


# --- runs and tables ---------------------------------------------------------


def test_table_says_which_failures_are_stable(mixed: Selection) -> None:
    table = mixed.table().set_index("id")
    assert list(table.columns) == ["r1", "r2", "alone", "stable"]
    assert table.loc[:, ["r1", "r2", "alone", "stable"]].to_dict("index") == {
        M + "test_pass": {"r1": "passed", "r2": "passed", "alone": "", "stable": "stable pass"},
        M + "test_fail": {
            "r1": "failed",
            "r2": "failed",
            "alone": "failed",
            "stable": "stable fail",
        },
        M + "test_flaky": {"r1": "failed", "r2": "passed", "alone": "passed", "stable": "flaky"},
        M + "test_skip": {"r1": "skipped", "r2": "skipped", "alone": "", "stable": "skipped"},
        M + "test_setup_error": {
            "r1": "error",
            "r2": "error",
            "alone": "error",
            "stable": "stable fail",
        },
        M + "test_marked[1]": {
            "r1": "passed",
            "r2": "passed",
            "alone": "",
            "stable": "stable pass",
        },
        M + "test_marked[2.5]": {
            "r1": "passed",
            "r2": "passed",
            "alone": "",
            "stable": "stable pass",
        },
        M + "TestGroup::test_method": {
            "r1": "passed",
            "r2": "passed",
            "alone": "",
            "stable": "stable pass",
        },
        OD + "test_leaves_state": {
            "r1": "passed",
            "r2": "passed",
            "alone": "",
            "stable": "stable pass",
        },
        OD + "test_needs_clean_state": {
            "r1": "failed",
            "r2": "failed",
            "alone": "passed",
            "stable": "fails only with others",
        },
    }
    assert mixed.flaky_ids() == [M + "test_flaky"]
    assert not mixed.ok and mixed.run_errors() == []


def test_runs_counts_and_isolated_failures(mixed: Selection) -> None:
    assert [(r.kind, r.index, r.test_id, r.returncode) for r in mixed.runs] == [
        ("repeat", 1, None, 1),
        ("repeat", 2, None, 1),
        ("alone", 1, M + "test_fail", 1),
        ("alone", 2, M + "test_flaky", 0),
        ("alone", 3, M + "test_setup_error", 1),
        ("alone", 4, OD + "test_needs_clean_state", 0),
    ]
    for run in mixed.runs:
        assert run.junit.is_file() and run.log.is_file() and run.seconds > 0 and run.error is None
    assert (
        mixed.runs[0].junit.name == "junit_r1.xml"
        and mixed.runs[2].junit.name == "junit_alone_1.xml"
    )
    counts = mixed.counts()
    assert counts["r1"] == {"passed": 5, "failed": 3, "error": 1, "skipped": 1}
    assert counts["r2"] == {"passed": 6, "failed": 2, "error": 1, "skipped": 1}
    assert counts["total"] == {"passed": 11, "failed": 5, "error": 2, "skipped": 2}
    assert counts["alone"] == {"passed": 2, "failed": 1, "error": 1, "skipped": 0}
    assert mixed.runs[0].summary.startswith("3 failed, 5 passed, 1 skipped, 1 error in ")
    lines = mixed.summary_lines()
    assert lines[0].startswith("r1: 3 failed, 5 passed") and "(exit 1, " in lines[0]
    assert lines[3].startswith(f"alone {M}test_flaky: 1 passed in ")


def test_failures_carry_the_first_error_line(mixed: Selection) -> None:
    failures = mixed.failures()
    assert list(failures.columns) == ["id", "repeat", "status", "message", "time"]
    rows = {(r["id"], r["repeat"]): r for r in failures.to_dict("records")}
    assert rows[(M + "test_fail", "r1")]["message"] == "AssertionError: always fails"
    assert rows[(M + "test_fail", "alone")]["status"] == "failed"
    assert rows[(M + "test_flaky", "r1")]["message"] == "AssertionError: fails on the first run"
    assert (M + "test_flaky", "r2") not in rows
    error = rows[(M + "test_setup_error", "r2")]
    assert error["status"] == "error" and "RuntimeError: broken fixture" in error["message"]
    assert all(isinstance(t, float) for t in failures["time"])


def test_results_are_json(mixed: Selection) -> None:
    results = json.loads(json.dumps(mixed.results()))
    assert results["counts"] == mixed.counts()["total"]
    assert results["ok"] is False and results["tests"] == 10 and results["repeats"] == 2
    assert results["failing_ids"] == [
        M + "test_fail",
        M + "test_flaky",
        M + "test_setup_error",
        OD + "test_needs_clean_state",
    ]
    assert results["flaky_ids"] == [M + "test_flaky"]
    assert results["verdicts"][OD + "test_needs_clean_state"] == "fails only with others"
    assert results["summary_lines"] == mixed.summary_lines()
    assert results["runs"][2]["junit"] == "junit_alone_1.xml"
    assert results["command"].endswith(f"--rootdir={mixed.tree}")  # no -m, no ids


def test_junit_keeps_the_raw_classname(mixed: Selection) -> None:
    cases = {c.id: c for c in read_junit(mixed.runs[0].junit, mixed.tree)}
    method = cases[M + "TestGroup::test_method"]
    assert (method.classname, method.name, method.status) == (
        "tests.test_mix.TestGroup",
        "test_method",
        "passed",
    )
    assert cases[M + "test_skip"].message.startswith("not here")


def test_markers_ids_and_skips_pass(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree", {"test_mix.py": MIX})
    marked = run_selection(tree, markers="gpuish", out_dir=tmp_path / "a", progress=False)
    assert marked.ids() == [M + "test_marked[1]", M + "test_marked[2.5]"]
    assert marked.ok and marked.runs[0].summary.startswith("2 passed, 6 deselected in ")
    chosen = run_selection(
        tree,
        markers=None,
        ids=[M + "test_pass", M + "test_skip"],
        out_dir=tmp_path / "b",
        progress=False,
    )
    assert chosen.ok and len(chosen.runs) == 1  # a skip is not a failure
    assert chosen.table()["stable"].tolist() == ["stable pass", "skipped"]
    assert chosen.executed() == 1 and chosen.outcome() == "passed"


def test_a_selection_whose_every_test_skips_is_no_tests_ran(tmp_path: Path) -> None:
    """-m cuda on a CPU: every selected test skips. That earned nothing: not ok, outcome 'no tests ran'."""
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    skips = run_selection(
        tree,
        markers=None,
        ids=["tests/test_simple.py::test_skip"],
        repeats=2,
        out_dir=tmp_path / "out",
        progress=False,
    )
    assert skips.counts()["total"]["skipped"] == 2 and skips.executed() == 0
    assert not skips.ok and skips.outcome() == "no tests ran" and skips.run_errors() == []
    assert skips.outcome_line().startswith("no tests ran: 1 selected, all skipped")


def test_nothing_collected_is_recorded(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    selection = run_selection(
        tree, markers="gpuish", repeats=2, out_dir=tmp_path / "out", progress=False
    )
    assert [r.returncode for r in selection.runs] == [5, 5]
    assert selection.runs[0].summary.startswith("3 deselected in ")
    assert selection.run_errors() == [] and selection.table().empty
    assert selection.counts()["total"] == {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    assert not selection.ok and selection.outcome() == "no tests ran"  # nothing ran: not a pass
    assert selection.results()["outcome"] == "no tests ran" and selection.results()["executed"] == 0
    # pytest 9 refuses an unregistered marker under --strict-markers: exit 4, a run error
    unknown = run_selection(tree, markers="cuda", out_dir=tmp_path / "out4", progress=False)
    assert unknown.runs[0].returncode == 4 and not unknown.ok
    assert unknown.run_errors()[0].startswith("r1: ")


def test_timeout_kills_the_run(tmp_path: Path) -> None:
    tree = make_tree(
        tmp_path / "tree", {"test_slow.py": "import time\n\ndef test_slow():\n    time.sleep(60)\n"}
    )
    selection = run_selection(
        tree, markers=None, out_dir=tmp_path / "out", timeout=1, progress=False
    )
    run = selection.runs[0]
    assert run.returncode is None and run.error == "timed out after 1 s" and run.seconds < 30
    assert not selection.ok and selection.run_errors() == ["r1: timed out after 1 s"]


def test_summary_line_and_node_ids(tmp_path: Path) -> None:
    log = "x\n\x1b[31m===== 1 failed, \x1b[32m2 passed\x1b[0m in 0.12s =====\x1b[0m\nwarning\n"
    assert pytest_summary_line(log) == "1 failed, 2 passed in 0.12s"
    assert pytest_summary_line("no tests ran in 0.01s\n") == "no tests ran in 0.01s"
    assert pytest_summary_line("3 passed, but no timing\n") == ""
    assert node_id("tests.test_x.TestA", "test_b[1.5-x]") == "tests/test_x.py::TestA::test_b[1.5-x]"
    assert node_id("", "tests.test_x") == "tests/test_x.py"  # a collection error or skip
    (tmp_path / "tests" / "Odd").mkdir(parents=True)
    (tmp_path / "tests" / "Odd" / "test_y.py").write_text("")
    assert node_id("tests.Odd.test_y", "test_z", tmp_path) == "tests/Odd/test_y.py::test_z"


# --- trees and archives -------------------------------------------------------


def test_resolve_directories(tmp_path: Path) -> None:
    assert resolve_tree(None, tmp_path) == resolve_tree("", tmp_path) == ROOT
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    assert resolve_tree(tree, tmp_path / "work") == tree.resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither tests/ nor pyproject\.toml"):
        resolve_tree(tmp_path / "empty", tmp_path)
    with pytest.raises(FileNotFoundError, match="tree not found"):
        resolve_tree(tmp_path / "nope.tar.gz", tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a directory or a"):
        resolve_tree(tmp_path / "notes.txt", tmp_path)


@pytest.mark.parametrize(
    ("name", "top"), [("t.tar.gz", "tree"), ("t.tgz", None), ("t.tar", "tree")]
)
def test_archive_round_trip(tmp_path: Path, name: str, top: str | None) -> None:
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    write_manifest(
        tree,
        {
            "tests/test_simple.py": sha(tree / "tests/test_simple.py"),
            "pyproject.toml": sha(tree / "pyproject.toml"),
        },
    )
    archive = pack(tree, tmp_path / name, top)
    work = tmp_path / "work"
    root = resolve_tree(archive, work)
    assert root.is_relative_to(work.resolve()) and (root / MANIFEST_NAME).is_file()
    assert root.name == "tree" if top else root.parent == work.resolve()
    selection = run_selection(
        root,
        markers=None,
        ids=["tests/test_simple.py::test_pass"],
        out_dir=tmp_path / "out",
        progress=False,
    )
    assert selection.ok and selection.table()["id"].tolist() == ["tests/test_simple.py::test_pass"]


def test_manifest_without_files_is_only_recorded(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    write_manifest(tree, None)
    assert resolve_tree(pack(tree, tmp_path / "t.tar.gz"), tmp_path / "work").name == "tree"


def test_manifest_mismatch_is_refused(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    good = sha(tree / "pyproject.toml")
    write_manifest(tree, {"pyproject.toml": good, "tests/test_simple.py": "f" * 64})
    with pytest.raises(ValueError, match=r"manifest mismatch: tests/test_simple\.py has sha256"):
        resolve_tree(pack(tree, tmp_path / "a.tar.gz"), tmp_path / "work")
    write_manifest(tree, {"pyproject.toml": good, "tests/gone.py": good})
    with pytest.raises(ValueError, match=r"tests/gone\.py is listed .* but missing"):
        resolve_tree(tree, tmp_path / "work")
    write_manifest(tree, {"../outside.py": good})
    with pytest.raises(ValueError, match="refusing manifest entry"):
        resolve_tree(tree, tmp_path / "work")


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "garbage", "empty"])
def test_broken_archive_is_refused_before_anything_runs(tmp_path: Path, damage: str) -> None:
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE + "\n# padding\n" * 2000})
    data = pack(tree, tmp_path / "good.tar.gz").read_bytes()
    if damage == "truncated":
        data = data[: len(data) - 40]
    elif damage == "corrupted":
        data = data[:200] + bytes(b ^ 0x5A for b in data[200:260]) + data[260:]
    elif damage == "garbage":
        data = b"not an archive at all" * 10
    else:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz"):
            pass
        data = buf.getvalue()
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(data)
    work = tmp_path / "work"
    with pytest.raises(ValueError, match="corrupted, truncated or unsafe archive"):
        resolve_tree(bad, work)
    assert list(work.iterdir()) == []  # nothing left behind, nothing ran


@pytest.mark.parametrize("member", ["../evil.py", "/tmp/evil.py", "tree/../../evil.py", "link"])
def test_unsafe_members_are_refused(tmp_path: Path, member: str) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("tree/pyproject.toml", "tree/tests/test_a.py"):
            info = tarfile.TarInfo(name)
            tar.addfile(info, io.BytesIO(b""))
        if member == "link":
            info = tarfile.TarInfo("tree/tests/escape")
            info.type, info.linkname = tarfile.SYMTYPE, "../../../etc/passwd"
            tar.addfile(info)
        else:
            payload = b"raise SystemExit('escaped')\n"
            info = tarfile.TarInfo(member)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    work = tmp_path / "a" / "b" / "work"
    with pytest.raises(ValueError, match="refusing archive"):
        resolve_tree(archive, work)
    assert not (tmp_path / "a" / "b" / "evil.py").exists() and list(work.iterdir()) == []


# --- command line and notebook ---------------------------------------------------


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    base = ["--tree", str(tree), "-m", "", "--no-progress"]
    passing = ["--id", "tests/test_simple.py::test_pass", "--id", "tests/test_simple.py::test_skip"]
    assert cli.verify([*base, *passing, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert (
        "tests/test_simple.py::test_skip" in out
        and "skipped" in out
        and "r1: 1 passed, 1 skipped" in out
    )
    assert cli.verify([*base, "--out", str(tmp_path / "b"), "--", "-x"]) == 1
    out = capsys.readouterr().out
    assert "ValueError: boom" in out and "alone tests/test_simple.py::test_fail: 1 failed" in out
    only_skip = ["--id", "tests/test_simple.py::test_skip"]
    assert (
        cli.verify([*base, *only_skip, "--out", str(tmp_path / "s")]) == 1
    )  # no tests ran: not a pass
    assert "outcome: no tests ran: 1 selected, all skipped" in capsys.readouterr().out
    (tmp_path / "bad.tgz").write_bytes(b"\x1f\x8b broken")
    assert cli.verify(["--tree", str(tmp_path / "bad.tgz"), "--out", str(tmp_path / "c")]) == 2
    assert "corrupted" in capsys.readouterr().err


def test_notebook_is_committed_clean() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.tags and "run_dir" in code[0].source


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_notebook_through_the_runner(tmp_path: Path) -> None:
    pytest.importorskip("papermill")
    from replaykit.workflow.runs import run_notebook

    tree = make_tree(tmp_path / "tree", {"test_simple.py": SIMPLE})
    failing = run_notebook(
        NOTEBOOK, {"tree": str(tree), "markers": ""}, runs_dir=tmp_path / "runs", progress=False
    )
    s = failing.summary
    assert (s["status"], s["reason"]) == ("failed", "exception")
    assert (
        s["failed_cell"]["ename"] == "AssertionError" and "test_fail" in s["failed_cell"]["evalue"]
    )
    assert s["failed_cell"]["index"] == s["cells"][-1]["index"]  # the last cell, after saving
    assert s["results"]["failing_ids"] == [
        "tests/test_simple.py::test_fail"
    ]  # saved before raising
    assert s["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert s["fingerprint_source"] == "notebook" and s["fingerprint"]["tree"]["path"] == str(
        tree.resolve()
    )
    assert (failing.run_dir / "pytest" / "junit_alone_1.xml").is_file()
    assert (failing.run_dir / "verify.csv").is_file()

    injected = {
        "tree": str(tree),
        "markers": "",
        "ids": ["tests/test_simple.py::test_pass", "tests/test_simple.py::test_skip"],
    }
    skips = run_notebook(NOTEBOOK, injected, runs_dir=tmp_path / "runs", progress=False)
    s = skips.summary
    assert skips.ok and s["status"] == "passed" and s["counts"]["skipped"] == 1
    # what test_notebooks.py checks of the other notebooks' papermill runs (verify's is this one)
    assert s["parameters"].items() >= injected.items() and (skips.run_dir / NOTEBOOK.name).exists()
    assert s["fingerprint_source"] == "notebook" and s.get("results")
    assert s["results"]["outcome"] == "passed"
    assert s["results"]["verdicts"] == {
        "tests/test_simple.py::test_pass": "stable pass",
        "tests/test_simple.py::test_skip": "skipped",
    }

    nothing = run_notebook(
        NOTEBOOK,
        {"tree": str(tree), "markers": "", "ids": ["tests/test_simple.py::test_skip"]},
        runs_dir=tmp_path / "runs",
        progress=False,
    )
    s = nothing.summary
    assert not nothing.ok and s["status"] == "failed" and s["results"]["outcome"] == "no tests ran"
    assert s["failed_cell"]["evalue"].startswith("no tests ran: 1 selected, all skipped")
