"""bisect.py: the first bad commit of a small repo made here, a skipped commit, arms side by side."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("papermill", reason="papermill tooling not installed")

from replaykit.workflow import cli
from replaykit.workflow.bisect import (
    BAD,
    GOOD,
    SKIP,
    EndpointError,
    arms,
    bisect,
    commits_between,
    search,
    verdict,
)

ROOT = Path(__file__).resolve().parents[2]
TEST_CALC = """\
import pytest
from calc import add


def test_add():
    assert add(2, 3) == 5


def test_other():
    assert True


@pytest.mark.gpu
@pytest.mark.skipif(True, reason="no GPU here")
def test_add_on_the_gpu():
    assert add(2, 3) == 5
"""
# (message, files to write, files to delete): commit 2 cannot be collected, commit 4 breaks add.
HISTORY = [
    (
        "add calc",
        {"calc.py": "def add(a, b):\n    return a + b\n", "tests/test_calc.py": TEST_CALC},
        [],
    ),
    (
        "conftest that cannot load",
        {"tests/conftest.py": "raise RuntimeError('broken conftest')\n"},
        [],
    ),
    ("drop the broken conftest", {"README": "calc\n"}, ["tests/conftest.py"]),
    ("subtract instead of adding", {"calc.py": "def add(a, b):\n    return a - b\n"}, []),
    ("document", {"README": "calc, documented\n"}, []),
    ("more docs", {"NOTES": "notes\n"}, []),
    ("even more docs", {"NOTES": "more notes\n"}, []),
]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The repo and its commits, oldest first."""
    path = tmp_path_factory.mktemp("calc")
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / "pyproject.toml").write_text(
        "[tool.pytest.ini_options]\npythonpath = ['.']\nmarkers = ['gpu: skipped on this host']\n"
    )
    shas = []
    for message, files, gone in HISTORY:
        for name, text in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(text)
        for name in gone:
            (path / name).unlink()
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", message)
        shas.append(git(path, "rev-parse", "HEAD"))
    return path, shas


@pytest.fixture(autouse=True)
def _fast_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner pytest runs need no installed plugins (nbval's import alone takes a second)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_search_with_skips() -> None:
    def fake(verdicts: str) -> tuple[list[int], list[int]]:
        tested: list[int] = []

        def test(i: int) -> str:
            tested.append(i)
            return {"g": GOOD, "b": BAD, "s": SKIP}[verdicts[i]]

        return search(len(verdicts), test), tested

    assert fake("ggggbbbb") == ([4], [3, 5, 4])
    assert fake("sgbbbb") == ([2], [2, 0, 1])  # the skip is stepped around
    assert fake("gsbb") == ([1, 2], [1, 0, 2])  # the skipped commit right before the first bad
    assert fake("b") == ([0], [])  # the bad end is never tested
    assert fake("ssss") == ([0, 1, 2, 3], [1, 0, 2])
    with pytest.raises(ValueError, match="expected good, bad or skip"):
        search(3, lambda i: "maybe")


def test_verdicts() -> None:
    def cell(status: str) -> dict:
        return {"status": status, "summary": f"{status} | verify.ipynb"}

    ok = {
        "status": "passed",
        "results": {"tests": 2, "failing_ids": [], "run_errors": [], "counts": {"passed": 2}},
    }
    assert verdict(cell("passed"), ok) == (GOOD, "2 passed")
    bad = {"results": {"tests": 2, "failing_ids": ["t.py::a"], "run_errors": []}}
    assert verdict(cell("failed"), bad) == (BAD, "1 failing: t.py::a")
    broken = {
        "results": {"tests": 1, "failing_ids": ["t.py"], "run_errors": ["r1: pytest exit 2 (...)"]}
    }
    assert verdict(cell("failed"), broken)[0] == SKIP
    assert verdict(cell("failed"), {"results": {"tests": 0}}) == (SKIP, "no tests selected")
    # every selected test skipped (-m cuda on a CPU): untestable, never good
    skipped = {
        "status": "passed",
        "results": {
            "tests": 71,
            "failing_ids": [],
            "run_errors": [],
            "counts": {"passed": 0, "skipped": 71},
        },
    }
    assert verdict(cell("passed"), skipped) == (SKIP, "no tests ran (71 skipped)")
    assert (
        verdict(cell("failed"), skipped | {"results": skipped["results"] | {"executed": 0}})[0]
        == SKIP
    )
    assert verdict(cell("failed"), {"results": None})[0] == SKIP
    assert verdict(cell("error"), None)[0] == SKIP


def test_commits_between(repo: tuple[Path, list[str]]) -> None:
    path, shas = repo
    commits = commits_between(path, shas[0], shas[-1])
    assert [c.sha for c in commits] == shas[1:]
    assert commits[2].subject == "subtract instead of adding" and commits[2].short == shas[3][:7]
    with pytest.raises(ValueError, match="not an ancestor"):
        commits_between(path, shas[-1], shas[0])
    with pytest.raises(ValueError, match="not a commit"):
        commits_between(path, "nope", shas[0])
    with pytest.raises(ValueError, match="no commits between"):
        commits_between(path, shas[2], shas[2])


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_bisect_finds_the_breaking_commit_around_a_skip(
    repo: tuple[Path, list[str]], tmp_path: Path
) -> None:
    path, shas = repo
    result = bisect(
        path, shas[0], shas[-1], markers=None, runs_dir=tmp_path / "runs", progress=False
    )
    assert result.first_bad is not None and result.first_bad.sha == shas[3]
    assert result.conclusion() == f"First bad commit: {shas[3][:7]} subtract instead of adding"
    assert (
        result.verdicts()
        == {
            shas[0][:7]: GOOD,
            shas[-1][:7]: BAD,  # the endpoints, run first
            shas[3][:7]: BAD,
            shas[1][:7]: SKIP,
            shas[2][:7]: GOOD,
        }
    )
    skipped = next(s for s in result.steps if s.verdict == SKIP)
    assert "exit 4" in skipped.why or "no junit" in skipped.why  # the conftest could not load
    bad = next(s for s in result.steps if s.verdict == BAD)
    assert bad.why == "1 failing: tests/test_calc.py::test_add"

    assert result.folder.name.startswith("bisect_") and result.folder.parent == tmp_path / "runs"
    index = json.loads(result.index.read_text())
    assert index["kind"] == "bisect" and index["result"]["first_bad"] == shas[3]
    assert [c["verdict"] for c in index["cells"]] == [GOOD, BAD, BAD, SKIP, GOOD]
    for step, cell in zip(result.steps, index["cells"], strict=True):
        assert (result.folder / cell["run_dir"] / "verify.ipynb").is_file()
        assert cell["tree"]["commit"] == step.commit.sha and step.run_dir == cell["run_dir"]
        summary = json.loads((result.folder / cell["run_dir"] / "summary.json").read_text())
        assert summary["fingerprint"]["tree"]["commit"] == step.commit.sha  # the packed tree ran
    report = (result.folder / "bisect.md").read_text()
    assert report == result.report() and "| commit | subject | verdict | why | run |" in report
    rows = [line for line in report.splitlines() if line.startswith(f"| {shas[1][:7]}")]
    assert len(rows) == 1 and "| skip |" in rows[0]
    assert report.index(f"| {shas[0][:7]} ") < report.index(
        f"| {shas[1][:7]} "
    )  # the good end first


def _assert_refused(folder: Path, message: str, good: str, bad: str) -> None:
    """A refused bisect kept its endpoint runs and named no commit."""
    index = json.loads((folder / "index.json").read_text())
    assert index["result"]["first_bad"] is None and index["result"]["candidates"] == []
    assert index["result"]["conclusion"] == f"No verdict: {index['result']['refused']}"
    assert [c["tree"]["commit"] for c in index["cells"]] == (
        [good] if "--good" in message else [good, bad]
    )
    assert "First bad commit" not in (folder / "bisect.md").read_text()


# a --good that fails the selection (after the bug): test_cli runs it through the command line
@pytest.mark.parametrize(
    ("good", "bad", "markers", "refusal"),
    [
        (
            0,
            2,
            None,
            "--bad {bad} 'drop the broken conftest' is not bad: it passes the selection",
        ),  # no bad commit
        (
            0,
            6,
            "gpu",
            "--good {good} 'add calc' is not good: untestable here",
        ),  # every test skips on this host
    ],
    ids=["no-bad-commit", "nothing-runs-here"],
)
def test_endpoints_are_checked_before_any_commit_is_named(
    repo: tuple[Path, list[str]],
    tmp_path: Path,
    good: int,
    bad: int,
    markers: str | None,
    refusal: str,
) -> None:
    """git bisect refuses these too: naming a commit here would be a verdict nobody earned."""
    path, shas = repo
    with pytest.raises(EndpointError) as info:
        bisect(
            path, shas[good], shas[bad], markers=markers, runs_dir=tmp_path / "runs", progress=False
        )
    message = refusal.format(good=shas[good][:7], bad=shas[bad][:7])
    assert str(info.value).startswith(message)
    _assert_refused(info.value.folder, message, shas[good], shas[bad])


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_arms_side_by_side(repo: tuple[Path, list[str]], tmp_path: Path) -> None:
    path, shas = repo
    diag = tmp_path / "diag"
    subprocess.run(["git", "clone", "-q", str(path), str(diag)], check=True)
    (diag / "calc.py").write_text("def add(a, b):\n    return b + a\n")  # the fix, uncommitted
    result = arms(
        {"baseline": shas[0], "candidate": shas[-1], "diagnostic": str(diag)},
        repo=path,
        markers=None,
        runs_dir=tmp_path / "runs",
        progress=False,
    )
    rows = {r["test"]: r for r in result.table()}
    assert rows["tests/test_calc.py::test_add"] == {
        "test": "tests/test_calc.py::test_add",
        "baseline": "passed",
        "candidate": "failed",
        "diagnostic": "passed",
    }
    assert rows["tests/test_calc.py::test_other"]["candidate"] == "passed"
    assert rows["result"] == {
        "test": "result",
        "baseline": "2 passed, 1 skipped",
        "candidate": "1 failed, 1 passed, 1 skipped",
        "diagnostic": "2 passed, 1 skipped",
    }
    assert [t["source"] for t in result.trees] == ["rev", "rev", "path"]
    assert result.trees[1]["commit"] == shas[-1] and result.trees[2]["dirty"] is True
    md = (result.folder / "arms.md").read_text()
    assert md.startswith("| test | baseline | candidate | diagnostic |")
    assert json.loads(result.index.read_text())["kind"] == "arms"


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_cli(
    repo: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, shas = repo
    base = ["--repo", str(path), "-m", "", "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    # adjacent endpoints: two runs, no search step (test_bisect_finds_... covers the search)
    assert cli.bisect([*base, "--good", shas[2], "--bad", shas[3]]) == 0
    out = capsys.readouterr().out
    assert f"First bad commit: {shas[3][:7]} subtract instead of adding" in out
    assert cli.bisect([*base, "--good", shas[4], "--bad", shas[2]]) == 2
    assert "not an ancestor" in capsys.readouterr().err
    assert cli.bisect([*base, "--good", shas[4], "--bad", shas[6]]) != 0  # a --good that fails
    captured = capsys.readouterr()
    assert "is not good" in captured.err and "First bad commit" not in captured.out
    message = f"--good {shas[4][:7]} 'document' is not good: it fails the selection"
    assert captured.err.startswith(f"error: {message}")
    (folder,) = re.findall(r"\(runs: (.+)\)", captured.err)
    _assert_refused(Path(folder), message, shas[4], shas[6])
    assert cli.bisect([*base, "--good", shas[0]]) == 2
    assert cli.bisect([*base, "--arm", "x"]) == 2
    assert "LABEL=TREE" in capsys.readouterr().err
