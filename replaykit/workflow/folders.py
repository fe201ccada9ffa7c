"""The runs/ layout that runs, batch, bisect and evidence share: file names, slugs, fresh folders.

It lives in a module of its own because ``index`` imports ``evidence``: a name defined in index
and read by evidence would make the two import each other.
"""

from __future__ import annotations

import re
from pathlib import Path

SUMMARY_FILE = "summary.json"
"""A run folder's record (``runs.run_notebook`` writes it, ``evidence`` reads it)."""
INDEX_FILE = "index.json"
"""A batch, bisect or arms folder's index (``index.write_index`` writes it, ``evidence`` reads it)."""

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")


def slug(text: str, *, lower: bool = True, empty: str = "x") -> str:
    """``text`` as one part of a folder name: runs of anything but letters, digits, ``.`` and ``-`` become ``-``."""
    out = _UNSAFE.sub("-", text).strip("-.")
    return (out.lower() if lower else out) or empty


def unique_folder(parent: Path, stem: str) -> Path:
    """``parent/stem`` created (``stem-2``, ``stem-3``… when taken); ``parent`` is created too."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = parent / (stem + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free folder for {stem} in {parent}")
