"""git.py: the one git runner: text out, a GitError (a ValueError) that names the command when git fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from replaykit.workflow.errors import WorkflowError
from replaykit.workflow.git import GitError, git, git_text


def test_output_and_failures(tmp_path: Path) -> None:
    plain, repo = tmp_path / "plain", tmp_path / "repo"
    plain.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "naïve.txt").write_text("x\n")
    assert (
        git_text(repo, "status", "--porcelain") == "?? naïve.txt"
    )  # unquoted, no trailing newline
    assert (
        git(repo, "hash-object", "--stdin", input=b"x\n").decode()
        == git_text(repo, "hash-object", "naïve.txt") + "\n"
    )
    with pytest.raises(
        GitError, match=r"git rev-parse --verify HEAD failed in .*repo: fatal"
    ) as failed:
        git(repo, "rev-parse", "--verify", "HEAD")  # no commit yet
    assert isinstance(failed.value, ValueError) and isinstance(failed.value, WorkflowError)
    assert (
        git(repo, "rev-parse", "--verify", "-q", "HEAD", ok=(0, 1)) == b""
    )  # an exit code the caller expects
    with pytest.raises(GitError, match="not a git repository"):
        git_text(plain, "rev-parse", "HEAD")
    with pytest.raises(GitError, match="no folder"):
        git(tmp_path / "missing", "status")
