"""The root of the workflow's own errors, so a caller can catch every one of them in one clause.

Each error also derives from the built-in class it was raised as before (``ValueError`` for bad
input, ``RuntimeError`` for a broken environment), so ``except ValueError`` keeps catching it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RunInterrupted", "WorkflowError"]


class WorkflowError(Exception):
    """Something the notebook workflow could not do, said in words a user can act on."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a notebook run, after the partial notebook and its summary were saved."""

    def __init__(self, run_dir: Path, notebook: Path) -> None:
        super().__init__(f"interrupted; the partial notebook is saved: {notebook}")
        self.run_dir, self.notebook = run_dir, notebook
