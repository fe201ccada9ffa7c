"""One cell of a batch, bisect or arms: one notebook run on one tree by one kernel, as an index record.

A cell never raises for a failing run: it is recorded (status passed, failed or error, with a
reason) and the caller goes on. A run whose kernel or fingerprint names another interpreter than
the environment's is an error ("wrong interpreter"), however it ended: its result is not evidence
for that environment.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from replaykit.workflow.interpreters import same_interpreter
from replaykit.workflow.runs import ensure_kernel, run_notebook, summary_line
from replaykit.workflow.trees import PreparedTree
from replaykit.workflow.verdict import skipped

__all__ = ["WRONG_INTERPRETER", "declares", "error_cell", "interpreter_problem", "run_cell"]

WRONG_INTERPRETER = "wrong interpreter"


def declares(notebook: Path, name: str) -> bool:
    """True when ``notebook``'s parameters cell assigns ``name``."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    pattern = re.compile(rf"^{re.escape(name)}\s*(:|=)", re.M)
    return any(
        "parameters" in c.get("metadata", {}).get("tags", []) and pattern.search(c.source)
        for c in nb.cells
    )


def interpreter_problem(summary: dict[str, Any], python: str) -> str | None:
    """Why the run did not use ``python`` (kernelspec or fingerprint), or None when it did."""
    spec = summary.get("kernel_executable")
    if not same_interpreter(spec, python):
        return f"kernelspec {summary.get('kernel')!r} launches {spec}, expected {python}"
    fp = summary.get("fingerprint") or {}
    ran = fp.get("executable") if summary.get("fingerprint_source") == "notebook" else None
    if ran and not same_interpreter(ran, python):
        return f"the notebook ran under {ran}, expected {python}"
    return None


def error_cell(base: dict[str, Any], reason: str, detail: str) -> dict[str, Any]:
    """An index record for a cell that did not run (or ran and must not count): status error."""
    first = detail.strip().splitlines()[0][:300] if detail.strip() else ""
    return base | {
        "status": "error",
        "reason": reason,
        "summary": f"error: {reason}: {first}".rstrip(": "),
        "detail": detail[-3000:],
        "run_dir": None,
        "sha256": None,
        "counts": None,
        "duration_s": 0.0,
    }


def run_cell(
    notebook: Path,
    parameters: dict[str, Any],
    tree: PreparedTree,
    *,
    folder: Path,
    kernel: str | None = None,
    python: str | None = None,
    env: str = "current",
    cell_timeout: int | None = None,
) -> dict[str, Any]:
    """Run one notebook into a run folder under ``folder``; return the index record. Never raises
    for a failing run (KeyboardInterrupt excepted).

    ``kernel`` None: this interpreter (``ensure_kernel``), checked against ``sys.executable``.
    """
    base = {
        "env": env,
        "python": python,
        "kernel": kernel,
        "tree": tree.record(),
        "notebook": str(notebook),
        "parameters": dict(parameters),
    }
    params = dict(parameters)
    cwd = None
    try:
        if tree.path is not None:
            if declares(notebook, "tree"):
                params.setdefault("tree", str(tree.path))
            else:
                cwd = tree.path
        if kernel is None:
            kernel, python = ensure_kernel(), sys.executable
            base |= {"kernel": kernel, "python": python}
        result = run_notebook(
            notebook,
            params,
            runs_dir=folder,
            kernel_name=kernel,
            cell_timeout=cell_timeout,
            progress=False,
            tree=tree.path,
            cwd=cwd,
        )
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        return error_cell(base, "exception", f"{type(exc).__name__}: {exc}")
    s = result.summary
    record = base | {
        "status": s["status"],
        "reason": s.get("reason"),
        "summary": summary_line(s),
        "run_dir": os.path.relpath(result.run_dir, folder),
        "sha256": s.get("sha256"),
        "counts": s.get("counts"),
        "skipped": skipped(s),
        "duration_s": s.get("duration_s"),
    }
    problem = interpreter_problem(s, python) if python else None
    if problem:
        record |= {
            "status": "error",
            "reason": WRONG_INTERPRETER,
            "summary": f"error: {WRONG_INTERPRETER}: {problem}",
            "detail": problem,
        }
    return record
