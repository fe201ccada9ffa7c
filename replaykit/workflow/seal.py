"""Bind a run's ``summary.json`` and its executed notebook so that neither can be edited alone.

The runner writes the run's verdict (status, reason, the failing cell, counts, results) and a
sha256 of the whole summary into the notebook's metadata (``metadata.replaykit``), then records
the sealed notebook's sha256 in the summary. Evidence then checks both ways: an edited notebook
no longer matches ``summary.sha256``, an edited summary no longer matches the digest in the
notebook, and the Result column is read from the notebook's own copy of the verdict.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .archive import file_sha256

__all__ = ["KEY", "VERDICT_KEYS", "cells_failed", "check", "read", "seal", "summary_digest"]

KEY = "replaykit"
VERDICT_KEYS = ("status", "reason", "failed_cell", "errors", "counts", "results")
"""What the Result column and the failure list are made of: sealed into the notebook."""


def _normal(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as summary.json stores it (JSON types only)."""
    return json.loads(json.dumps(summary, default=str))


def summary_digest(summary: dict[str, Any]) -> str:
    """sha256 of the summary without its ``sha256`` entry (which hashes the sealed notebook)."""
    body = {k: v for k, v in _normal(summary).items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(notebook: Path, summary: dict[str, Any]) -> None:
    """Write the verdict and the summary's digest into ``notebook``; set ``summary["sha256"]`` to
    the sealed file's hash. Call it last: any later change to either side breaks the seal."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    normal = _normal(summary)
    nb.metadata[KEY] = {"summary_sha256": summary_digest(summary),
                        "verdict": {k: normal.get(k) for k in VERDICT_KEYS}}
    nbformat.write(nb, str(notebook))
    summary["sha256"] = file_sha256(notebook)


def read(notebook: Path) -> tuple[dict[str, Any] | None, Any]:
    """(the seal or None when the notebook has none, the notebook); ValueError when unreadable."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except Exception as exc:  # a truncated or hand-mangled file
        raise ValueError(f"{notebook}: unreadable notebook ({exc})") from exc
    sealed = nb.metadata.get(KEY)
    return (dict(sealed) if isinstance(sealed, dict) else None), nb


def cells_failed(nb: Any) -> bool:
    """True when a code cell of the executed notebook failed (papermill's status or an error output)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.get("metadata", {}).get("papermill", {}).get("status") == "failed":
            return True
        if any(out.get("output_type") == "error" for out in cell.get("outputs", [])):
            return True
    return False


def check(notebook: Path, summary: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """(the notebook's sealed verdict or None, problems). A problem is an edited summary (its
    digest differs from the seal) or a verdict that disagrees with the notebook's own cells."""
    sealed, nb = read(notebook)
    problems = []
    verdict = sealed.get("verdict") if sealed else None
    if sealed is not None and sealed.get("summary_sha256") != summary_digest(summary):
        changed = [k for k in VERDICT_KEYS if isinstance(verdict, dict) and verdict.get(k) != _normal(summary).get(k)]
        what = f" ({', '.join(changed)} differ from the notebook's)" if changed else ""
        problems.append(f"{notebook.parent / 'summary.json'}: EDITED after the run{what}")
    status = (verdict or summary).get("status")
    if status == "passed" and cells_failed(nb):
        problems.append(f"{notebook}: a cell failed, but the run is recorded as passed")
    return (verdict if isinstance(verdict, dict) else None), problems
