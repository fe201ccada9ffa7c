"""The folder of a batch, bisect or arms, and its index: ``index.json`` for tools, ``index.md`` for people.

    folder = new_folder(Path("runs"), "batch", "nightly")   # runs/batch_<UTC>_nightly/
    write_index(folder, {"kind": "batch", "cells": cells}, "Batch nightly")

The index is rewritten (atomically) after every cell, so an interrupted batch leaves a readable
one; ``evidence`` reads it.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from replaykit.workflow import tables
from replaykit.workflow.folders import INDEX_FILE, slug, unique_folder
from replaykit.workflow.verdict import tree_text

__all__ = ["INDEX_COLUMNS", "INDEX_MD", "INDEX_SCHEMA", "index_rows", "new_folder", "write_index"]

INDEX_MD = "index.md"
INDEX_SCHEMA = 1
INDEX_COLUMNS = ("env", "tree", "notebook", "parameters", "status", "summary", "run_dir")


def new_folder(runs_dir: Path, kind: str, name: str) -> Path:
    """``runs_dir/<kind>_<UTC>_<name>`` (``-2``, ``-3``… when taken), created."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return unique_folder(runs_dir, f"{kind}_{now.strftime('%Y%m%dT%H%M%SZ')}_{slug(name)}")


def _tree_text(tree: dict[str, Any]) -> str:
    return tree_text(tree, tree["label"]) if tree.get("commit") else tree["label"]


def index_rows(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for ``tables`` (one per cell): env, tree, notebook, parameters, status, summary, run_dir."""
    rows = []
    for c in cells:
        status = c["status"]
        if c.get("reason") and status != "passed":
            status += f" ({c['reason']})"
        elif status == "passed" and c.get("skipped"):  # not a full pass
            status += f", {c['skipped']} skipped"
        params = json.dumps(c["parameters"], sort_keys=True) if c["parameters"] else ""
        rows.append(
            {
                "env": c["env"],
                "tree": _tree_text(c["tree"]),
                "notebook": Path(c["notebook"]).name,
                "parameters": params,
                "status": status,
                "summary": c["summary"],
                "run_dir": c.get("run_dir") or "",
            }
        )
    return rows


def write_index(folder: Path, doc: dict[str, Any], title: str) -> Path:
    """Write ``index.json`` (atomically) and ``index.md`` into ``folder``; return the JSON path."""
    cells = doc.get("cells", [])
    counts: dict[str, int] = {}
    for c in cells:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    doc = {"schema": INDEX_SCHEMA, **doc, "counts": counts}
    path = Path(folder) / INDEX_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
    tally = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no cells yet"
    if rows_skipped := sum(int(c.get("skipped") or 0) for c in cells):
        tally += f" ({rows_skipped} rows or tests skipped: never run, never counted as passed)"
    md = [
        f"# {title}",
        "",
        f"{len(cells)} cells: {tally}",
        "",
        tables.markdown(index_rows(cells), INDEX_COLUMNS),
        "",
    ]
    (Path(folder) / INDEX_MD).write_text("\n".join(md))
    return path
