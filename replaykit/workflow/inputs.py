"""Cheap checks of a command's input, made before anything heavy is imported or written.

The rule every command keeps: bad input gives one line on stderr, exit code 2, and nothing
written. papermill, nbclient and nbformat take seconds to import, so what can be checked with the
standard library (a path exists, an interpreter runs, a notebook ever ran, a package is installed)
is checked here first. Standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "INSTALL_HINT",
    "executed_notebook",
    "interpreter",
    "missing_modules",
    "needs",
    "notebook",
    "tree_value",
]

INSTALL_HINT = "pip install 'replaykit[workflow]'"
URL_PREFIXES = ("https://", "http://", "git@", "ssh://", "file://")


def missing_modules(*modules: str) -> list[str]:
    """The top-level modules among ``modules`` that are not installed (found, not imported)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def needs(command: str, *modules: str) -> None:
    """ValueError naming the extra to install when ``command`` lacks one of ``modules``."""
    if missing := missing_modules(*modules):
        raise ValueError(
            f"`replaykit-workflow {command}` needs {', '.join(missing)}, not installed here: "
            f"{INSTALL_HINT}"
        )


def notebook(path: str | Path) -> Path:
    """An existing notebook file; FileNotFoundError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"notebook not found: {path}")
    return path


def tree_value(value: Any, what: str = "-p tree") -> None:
    """A notebook's ``tree`` parameter: ``""``, ``"upload"``, a git URL, or a path that exists."""
    if not isinstance(value, str) or not value or value == "upload":
        return
    if value.startswith(URL_PREFIXES) or value.startswith("/content/drive"):
        return
    if not Path(value).expanduser().exists():
        raise FileNotFoundError(f"{what} {value}: no such archive or folder")


def interpreter(python: str, what: str) -> None:
    """An interpreter path (or a name on PATH) that exists and may be executed."""
    found = shutil.which(python) if os.sep not in python else python
    if not found or not Path(found).is_file() or not os.access(found, os.X_OK):
        raise FileNotFoundError(f"{what}: no such interpreter: {python}")


def executed_notebook(path: Path) -> None:
    """A notebook that ran: valid JSON with at least one executed code cell or an output.
    ValueError otherwise: a notebook that never ran is no evidence, not even an unsealed one."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable notebook ({exc})") from None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise ValueError(f"{path}: not a notebook (no cells)")
    ran = any(
        isinstance(c, dict)
        and c.get("cell_type") == "code"
        and (isinstance(c.get("execution_count"), int) or c.get("outputs"))
        for c in cells
    )
    if not ran:
        raise ValueError(f"{path}: never executed (no cell has run): not evidence of anything")
