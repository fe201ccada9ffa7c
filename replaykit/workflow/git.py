"""Git as a subprocess: the one way the workflow asks a repository something. Standard library only.

Every call runs ``git --no-optional-locks -c core.quotepath=off``: reading a checkout never takes
the index lock a concurrent ``git`` in that checkout may hold, and paths come back unquoted.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from replaykit.workflow.errors import WorkflowError

__all__ = ["GitError", "git", "git_text"]


class GitError(WorkflowError, ValueError):
    """A git command failed (or git is missing): the message names the command, the folder and git's stderr."""


def git(
    repo: str | Path,
    *args: str,
    input: bytes | None = None,
    ok: tuple[int, ...] = (0,),
    timeout: float | None = None,
) -> bytes:
    """stdout of ``git ARGS`` run in ``repo``; GitError when its exit code is not in ``ok``."""
    cmd = ["git", "--no-optional-locks", "-c", "core.quotepath=off", *args]
    try:
        proc = subprocess.run(
            cmd, cwd=repo, input=input, capture_output=True, check=False, timeout=timeout
        )
    except FileNotFoundError as exc:
        missing = "git not found" if Path(repo).is_dir() else f"no folder {repo}"
        raise GitError(f"cannot run git {' '.join(args[:3])}: {missing}") from exc
    except subprocess.TimeoutExpired as exc:
        raise GitError(f"git {' '.join(args[:3])} timed out after {timeout} s in {repo}") from exc
    if proc.returncode not in ok:
        msg = proc.stderr.decode(errors="replace").strip()
        raise GitError(f"git {' '.join(args[:3])} failed in {repo}: {msg}")
    return proc.stdout


def git_text(repo: str | Path, *args: str, timeout: float | None = None) -> str:
    """stdout of ``git ARGS`` as text without its trailing newline; GitError when it fails."""
    return git(repo, *args, timeout=timeout).decode(errors="replace").rstrip("\n")
