"""The root of the workflow's own errors, so a caller can catch every one of them in one clause.

Each error also derives from the built-in class it was raised as before (``ValueError`` for bad
input, ``RuntimeError`` for a broken environment), so ``except ValueError`` keeps catching it.
"""

from __future__ import annotations

__all__ = ["WorkflowError"]


class WorkflowError(Exception):
    """Something the notebook workflow could not do, said in words a user can act on."""
