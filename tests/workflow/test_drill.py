"""drill.py: a planted bad commit on a throwaway copy of history, and bisect naming it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from replaykit.workflow.drill import DEFAULT_PLANT, Plant, main, plant_history

ROOT = Path(__file__).resolve().parents[2]
CALC = "def add(a, b):\n    return a + b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
BUG = Plant("calc.py", "return a + b", "return a - b")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, list[str]]:
    """Five healthy commits: the drill plants the bug, the history here has none."""
    path = tmp_path / "src"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / "pyproject.toml").write_text("[tool.pytest.ini_options]\npythonpath = ['.']\n")
    (path / "calc.py").write_text(CALC)
    (path / "tests").mkdir()
    (path / "tests" / "test_calc.py").write_text(TEST)
    shas = []
    for i in range(5):
        (path / "NOTES").write_text(f"note {i}\n")
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", f"commit {i}")
        shas.append(git(path, "rev-parse", "HEAD"))
    return path, shas


def test_the_plant_lands_from_its_commit_on_and_the_source_is_untouched(
    repo: tuple[Path, list[str]], tmp_path: Path
) -> None:
    path, shas = repo
    planted = plant_history(path, shas[0], shas[-1], tmp_path / "copy", plant=BUG, at=2)
    assert (
        len(planted.commits) == 5
        and planted.originals == shas
        and planted.planted == planted.commits[2]
    )
    calc = [git(planted.repo, "show", f"{c}:calc.py") for c in planted.commits]
    assert calc[:2] == [CALC.strip(), CALC.strip()] and all("a - b" in text for text in calc[2:])
    assert "[drill: bug planted in calc.py]" in git(
        planted.repo, "log", "-1", "--format=%s", planted.planted
    )
    assert git(planted.repo, "rev-parse", "drill") == planted.bad
    assert (
        git(path, "rev-parse", "HEAD") == shas[-1] and git(path, "branch", "--list", "drill") == ""
    )
    with pytest.raises(ValueError, match="holds 'nowhere' 0 times"):
        plant_history(
            path, shas[0], shas[-1], tmp_path / "copy2", plant=Plant("calc.py", "nowhere", "x")
        )


def test_the_default_plant_applies_to_this_checkout(tmp_path: Path) -> None:
    """The H200 drill plants in the CUDA backend: the text it replaces must still be there."""
    assert (ROOT / DEFAULT_PLANT.path).read_text().count(DEFAULT_PLANT.old) == 1


def test_dry_run_prints_the_plan(
    repo: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, shas = repo
    args = [
        "--repo",
        str(path),
        "--range",
        f"{shas[0]}..{shas[-1]}",
        "--file",
        "calc.py",
        "--old",
        "return a + b",
        "--new",
        "return a - b",
        "--dry-run",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "copied 5 commits" in out and out.count("<- planted") == 1
    assert main(["--repo", str(path), "--range", "nonsense"]) == 2


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_the_drill_names_the_planted_commit(
    repo: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("papermill")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    path, shas = repo
    # three commits, the bug planted in the middle one: three notebook runs (the endpoints, then
    # the middle), and bisect must name the middle commit, not the bad end
    args = [
        "--repo",
        str(path),
        "--range",
        f"{shas[0]}..{shas[2]}",
        "--file",
        "calc.py",
        "--old",
        "return a + b",
        "--new",
        "return a - b",
        "--plant-at",
        "1",
        "-m",
        "",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--no-progress",
    ]
    assert main(args) == 0
    (folder,) = (tmp_path / "runs").glob("bisect_*")
    drill = json.loads((folder / "drill.json").read_text())
    assert drill["ok"] is True and drill["named"] == drill["planted"] == drill["commits"][1]
