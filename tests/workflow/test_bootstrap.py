"""The notebooks' bootstrap: loads by path without torch, installs a notebook's missing share (never
torch) or names the fix in one line, and the bootstrap cell clones each git URL and ref on its own."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from replaykit.workflow import bootstrap

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = """[project]
name = "replaykit"
[project.optional-dependencies]
lightning = ["lightning>=2.2"]
testing = ["replaykit[lightning]", "torch>=2.4", "nvidia-cudnn-cu12", "tqdm"]
notebooks = ["no-such-dist-for-replaykit>=1", "pandas>=2"]
verify = ["pytest>=8"]
"""


def test_loads_by_path_without_torch() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rk_boot', {str(ROOT / 'replaykit/workflow/bootstrap.py')!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'replaykit')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip() == "[]"


def test_a_notebooks_requirements_come_from_the_trees_extras_without_torch(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    assert bootstrap.requirements(tmp_path, ["testing"]) == ["tqdm", "lightning>=2.2"]
    assert bootstrap.requirements(ROOT, bootstrap.NOTEBOOK_EXTRAS["verify"]) == [
        "tqdm>=4.60",
        "pytest>=8",
        "junitparser>=3",
        "pandas>=2",
        "lightning>=2.2",
    ]
    with pytest.raises(ValueError, match="no extra 'gpu'"):
        bootstrap.requirements(tmp_path, ["gpu"])


def test_ensure_installs_nothing_present(capsys: pytest.CaptureFixture[str]) -> None:
    assert bootstrap.ensure(["pytest>=8", "pandas"]) == []
    assert "nothing to install: pytest, pandas present" in capsys.readouterr().out


def test_what_cannot_be_installed_is_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline (a wheelhouse without it): pip fails, and the error says the command that works."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "wheelhouse").mkdir()
    (tmp_path / "wheelhouse" / "other-1.0-py3-none-any.whl").write_bytes(b"not this one")
    with pytest.raises(RuntimeError) as info:
        bootstrap.ensure(["no-such-dist-for-replaykit>=1"], tmp_path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "pip could not install no-such-dist-for-replaykit>=1"
    )
    assert message.endswith(
        f"fix: %pip install --no-index --find-links {tmp_path / 'wheelhouse'} 'no-such-dist-for-replaykit>=1'"
    )
    # not installing (one's own environment), the notebook names what it lacks
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    with pytest.raises(
        RuntimeError,
        match=r"^the hazards notebook needs no-such-dist-for-replaykit>=1; fix: %pip install",
    ):
        bootstrap.bootstrap(tmp_path, "hazards", install=False)
    assert sys.path[0] == str(tmp_path.resolve())


def _git(cwd: Path, *args: str) -> str:
    env = os.environ | {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=env
    ).stdout.strip()


def _bootstrap_cell() -> str:
    cells = json.loads((ROOT / "notebooks" / "hazards.ipynb").read_text())["cells"]
    return next(
        "".join(c["source"]) for c in cells if "".join(c["source"]).startswith("# Bootstrap")
    )


def _tree_without_runs(where: Path) -> Path:
    """A one-commit repository of HEAD's tree without runs/ (the saved evidence, 45 MB of a 48 MB
    tree that the cell needs none of): each file:// clone packs it, 3.5 s a clone with runs/."""
    where.mkdir()
    archive = subprocess.run(
        ["git", "archive", "HEAD", "--", ".", ":(exclude)runs"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    _git(where, "init", "-q")
    _git(where, "add", "-A")
    _git(where, "commit", "-q", "-m", "HEAD without runs/")
    return where


@pytest.mark.slow
def test_the_cell_clones_each_git_url_and_ref_on_its_own(tmp_path: Path) -> None:
    """A second URL or ref never tests the first one's clone; the fingerprint names the commit."""
    origin = tmp_path / "origin.git"
    _git(tmp_path, "clone", "-q", "--bare", str(_tree_without_runs(tmp_path / "src")), str(origin))
    work = tmp_path / "w"
    _git(tmp_path, "clone", "-q", str(origin), str(work))
    _git(work, "commit", "-q", "--allow-empty", "-m", "another commit")
    _git(work, "push", "-q", "origin", "HEAD:refs/heads/other")
    head, other = _git(origin, "rev-parse", "HEAD"), _git(work, "rev-parse", "HEAD")
    probe = (
        "\nfrom replaykit.workflow.fingerprint import tree_info\nimport replaykit\n"
        "print(replaykit.__file__, tree_info()['commit'], tree_info().get('remote'))"
    )
    seen = {}
    for tree in (f"file://{origin}@other", f"file://{origin}", f"file://{origin}@{other[:12]}"):
        code = f"tree = {tree!r}\n" + _bootstrap_cell() + probe
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        where, commit, remote = out.stdout.split()[-3:]
        assert (
            Path(where).is_relative_to(tmp_path / "replaykit-src") and remote == f"file://{origin}"
        )
        seen[tree] = (Path(where).parents[1], commit)
    assert [c for _, c in seen.values()] == [other, head, other]
    assert len({folder for folder, _ in seen.values()}) == 3  # one clone per URL and ref


def test_the_torch_floor_is_the_trees_own_and_an_older_torch_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bootstrap checks torch against the floor pyproject.toml declares (one source), so the
    range the docs state (docs/workflow.md) is the one enforced; Colab's 2.8-2.11 pass."""
    assert bootstrap.torch_floor(ROOT) == "2.4"
    monkeypatch.setattr(sys, "path", [*sys.path])  # the bootstrap puts the tree first on both
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    versions = {"torch": "2.3.1"}
    real = bootstrap.installed
    monkeypatch.setattr(bootstrap, "installed", lambda n: versions.get(n) or real(n))
    with pytest.raises(
        RuntimeError, match=r"^torch 2\.3\.1 is older than this tree supports \(torch>=2\.4"
    ):
        bootstrap.bootstrap(str(ROOT), "hazards", install=False)
    for colab in ("2.11.0+cu128", "2.10.0+cu126", "2.9.0+cu126", "2.8.0+cu126"):
        versions["torch"] = colab
        bootstrap.check_torch(ROOT)
    assert "torch 2.8.0+cu126: supported (torch>=2.4), but no run" in capsys.readouterr().out
    versions["torch"] = "2.11.0+cu128"
    bootstrap.check_torch(ROOT)
    assert capsys.readouterr().out == ""  # a release with run evidence: nothing to say
