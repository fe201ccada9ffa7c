# One module: every part of the report reads the same run records (summary, index, executed notebook).
"""Evidence for an engineering log, read from run folders: the table, failures, links, integrity.

    ev = collect(runs=[Path("runs")], batches=[Path("runs/batch_x/index.json")])
    print(ev.markdown())      # | Tree | Runtime | Result | … ready to paste
    ev.edited                 # runs whose executed notebook changed after the run

A run folder is one ``replaykit.runs.run_notebook`` run (``summary.json`` + the executed
notebook). A bare ``.ipynb`` (downloaded from Colab, a Drive folder of them) is read by the seal its
last cell left in it (``seal.finish``). A batch or bisect folder holds ``index.json`` (``replaykit.batch``) and its runs;
reading through it adds each run's tree label, and cells that never ran (an environment that
could not be built) appear as errors. Folders without a notebook summary are skipped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replaykit.workflow import tables

from .bootstrap import file_sha256
from .folders import INDEX_FILE, SUMMARY_FILE
from .seal import cells_failed, check, check_notebook
from .verdict import (
    EXECUTED,
    ORDER,
    counts_text,
    parts,
    result_text,
    runtime_text,
    tree_text,
)

__all__ = [
    "EXECUTED",
    "ORDER",
    "Evidence",
    "RunEvidence",
    "collect",
    "counts_text",
    "load_notebook",
    "load_run",
    "parts",
    "result_text",
    "runtime_text",
    "tree_text",
]

COLUMNS = ("Tree", "Runtime", "Result")
OK, EDITED, MISSING, UNHASHED, UNSEALED = "ok", "EDITED", "MISSING", "no hash", "unsealed"
"""``unsealed``: a run from before the runner sealed its summary into the notebook
(``replaykit.workflow.seal``); its notebook is checked, its summary cannot be."""


# --- one run -----------------------------------------------------------------


@dataclass
class RunEvidence:
    """One run (or a batch cell that never ran) and what the evidence says about it."""

    folder: Path | None
    summary: dict[str, Any] | None
    label: str | None = None  # the tree's label from a batch index
    env: str | None = None
    cell: dict[str, Any] | None = None  # the batch index record, when read through one
    integrity: str = OK
    problems: list[str] = field(default_factory=list)
    bare: Path | None = None  # a downloaded notebook read by its own seal (no run folder)

    @property
    def notebook(self) -> Path | None:
        if self.bare is not None:
            return self.bare
        if self.folder is None or not self.summary:
            return None
        return self.folder / self.summary.get("output", "")

    @property
    def fingerprint(self) -> dict[str, Any]:
        return (self.summary or {}).get("fingerprint") or {}

    @property
    def results(self) -> dict[str, Any]:
        results = (self.summary or {}).get("results")
        return results if isinstance(results, dict) else {}

    def tree(self) -> str:
        return tree_text(
            self.fingerprint.get("tree") or {}, self.label, (self.cell or {}).get("tree")
        )

    def runtime(self) -> str:
        if self.summary is None:
            return f"{self.env} (not run)" if self.env else "(not run)"
        return runtime_text(self.fingerprint)

    def result(self) -> str:
        if self.summary is None:
            cell = self.cell or {}
            return f"{cell.get('status', 'error')}: {cell.get('reason') or ''}".rstrip(": ")
        text = result_text(self.summary)
        cell = self.cell or {}
        if cell.get("status") and cell["status"] != self.summary.get(
            "status"
        ):  # e.g. wrong interpreter
            text += f" ({cell['status']}: {cell.get('reason')})"
        if self.bare is not None and self.integrity == UNSEALED:
            return f"{text} **{UNSEALED}**"
        return f"{text} **{self.integrity}**" if self.integrity in (EDITED, MISSING) else text

    def failures(self) -> list[dict[str, str]]:
        """Failing ids (verify), failed scenarios (parity), or the failing cell, with a first line."""
        return failures(self)


def check_integrity(run: RunEvidence) -> None:
    """Set ``run.integrity``: the executed notebook's sha256 against summary.json (and the index),
    and summary.json against the digest sealed into the notebook. The verdict the notebook holds
    replaces the summary's, so the Result column is the notebook's, even when the summary was edited."""
    if run.summary is None:
        return
    path = run.notebook
    recorded = run.summary.get("sha256")
    indexed = (run.cell or {}).get("sha256")
    if not recorded:  # papermill never saved it (e.g. the kernel did not start)
        run.integrity = UNHASHED
        run.problems.append(
            f"{run.folder}: summary.json records no sha256: the run saved no notebook"
        )
        return
    if path is None or not path.is_file():
        run.integrity = MISSING
        run.problems.append(f"{path}: the executed notebook is missing")
        return
    actual = file_sha256(path)
    if actual != recorded:
        run.integrity = EDITED
        run.problems.append(
            f"{path}: EDITED after the run (sha256 {actual[:12]}…, summary.json says {recorded[:12]}…)"
        )
    elif indexed and indexed != recorded:
        run.integrity = EDITED
        run.problems.append(
            f"{path}: summary.json sha256 {recorded[:12]}… differs from the batch index's {indexed[:12]}…"
        )
    else:
        _check_seal(run, path)


def _check_seal(run: RunEvidence, path: Path) -> None:
    """The summary against the notebook's seal; the notebook's verdict becomes the run's."""
    assert run.summary is not None
    try:
        verdict, problems = check(path, run.summary)
    except ValueError as exc:
        run.integrity = EDITED
        run.problems.append(str(exc))
        return
    if verdict is None:
        run.integrity = UNSEALED
        run.problems.append(
            f"{path}: no seal (a run from before seals): summary.json is read unchecked"
        )
    if verdict is not None:
        run.summary = run.summary | verdict
    try:  # the notebook's own seal (its last cell), when it reached it: sources and outputs
        problems += check_notebook(path)[1]
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        run.integrity = EDITED
        run.problems += problems


def load_notebook(path: Path) -> RunEvidence:
    """A downloaded executed notebook (File > Download, a Drive folder), judged by its own seal.

    Sealed: the verdict is the seal's, checked against its digest and the notebook's cells.
    Not sealed (it stopped before its last cell, or predates seals): it is listed with the cell
    that failed, and never as a pass.
    """
    path = Path(path)
    try:
        sealed, problems, nb = check_notebook(path)
    except ValueError as exc:
        run = RunEvidence(folder=path.parent, summary=None, integrity=EDITED, bare=path)
        run.problems.append(str(exc))
        return run
    if sealed is None:
        summary = _unsealed_summary(path, nb)
        run = RunEvidence(folder=path.parent, summary=summary, integrity=UNSEALED, bare=path)
        run.problems.append(
            f"{path}: no seal (the notebook did not reach its last cell): never read as a pass"
        )
        return run
    summary = {
        "notebook": sealed.get("notebook") or path.name,
        "output": path.name,
        "status": sealed.get("status"),
        "reason": sealed.get("reason"),
        "results": sealed.get("results"),
        "counts": sealed.get("counts"),
        "fingerprint": sealed.get("fingerprint") or {},
        "parameters": sealed.get("parameters"),
        "failures": sealed.get("failures") or [],
        "failed_cell": None,
        "errors": [],
    }
    run = RunEvidence(folder=path.parent, summary=summary, bare=path)
    if problems:
        run.integrity = EDITED
        run.problems += problems
    return run


def _unsealed_summary(path: Path, nb: Any) -> dict[str, Any]:
    """What an unsealed notebook shows: the first failing cell, else that it has no verdict."""
    failed = None
    for index, cell in enumerate(nb.cells):
        err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
        if cell.cell_type == "code" and err is not None:
            failed = {"index": index, "ename": err.get("ename"), "evalue": err.get("evalue")}
            break
    status, reason = ("failed", "exception") if cells_failed(nb) else ("error", "not sealed")
    return {
        "notebook": path.name,
        "output": path.name,
        "status": status,
        "reason": reason,
        "results": None,
        "counts": None,
        "fingerprint": {},
        "failed_cell": failed,
        "errors": [],
    }


def load_run(
    folder: Path,
    *,
    label: str | None = None,
    env: str | None = None,
    cell: dict[str, Any] | None = None,
) -> RunEvidence | None:
    """The run in ``folder`` with its integrity checked, or None when it holds no notebook summary."""
    folder = Path(folder)
    try:
        summary = json.loads((folder / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or "output" not in summary or "status" not in summary:
        return None  # e.g. an older hand-written summary
    run = RunEvidence(folder=folder, summary=summary, label=label, env=env, cell=cell)
    check_integrity(run)
    commit = (run.fingerprint.get("tree") or {}).get("commit")
    intended = ((cell or {}).get("tree") or {}).get("commit")
    if cell and cell.get("status") and cell["status"] != summary["status"]:
        run.problems.append(f"{folder}: the batch recorded {cell.get('summary') or cell['status']}")
    if commit and intended and commit != intended:
        run.problems.append(
            f"{folder}: the notebook saw commit {commit[:7]}, the batch meant {intended[:7]}"
        )
    return run


# --- failures ----------------------------------------------------------------


def _key(test_id: str) -> str:
    """A test id and a junit classname.name brought to one form (``tests.test_x.TestA.test_b[1]``)."""
    head, bracket, tail = test_id.partition("[")
    head = re.sub(r"\.py(?=::|$)", "", head).replace("::", ".").replace("/", ".")
    return head + bracket + tail


def _junit_messages(run: RunEvidence) -> dict[str, str]:
    """First error line per failing case, from the verify notebook's junit files."""
    if run.folder is None:
        return {}
    from replaykit.workflow.verify import read_junit

    messages: dict[str, str] = {}
    for record in run.results.get("runs") or []:
        path = run.folder / "pytest" / str(record.get("junit", ""))
        if not path.is_file():
            continue
        try:
            cases = read_junit(path)
        except Exception:  # a half-written file from a killed run
            continue
        for case in cases:
            if case.status in ("failed", "error"):
                key = _key(f"{case.classname}.{case.name}" if case.classname else case.name)
                messages.setdefault(key, case.message)
    return messages


def failures(run: RunEvidence) -> list[dict[str, str]]:
    """Rows ``id``, ``status``, ``message`` for each failure the run recorded."""
    results, summary = run.results, run.summary or {}
    ids = results.get("failing_ids")
    if isinstance(ids, list) and ids:
        messages = _junit_messages(run)
        verdicts = results.get("verdicts") or {}
        return [
            {"id": i, "status": verdicts.get(i, "failed"), "message": messages.get(_key(i), "")}
            for i in ids
        ]
    run_errors = results.get("run_errors")
    if isinstance(run_errors, list) and run_errors:
        return [
            {"id": "pytest", "status": "run error", "message": str(e)[:300]} for e in run_errors
        ]
    failed = results.get("failed")
    if isinstance(failed, list) and failed:
        return [{"id": str(name), "status": "failed", "message": ""} for name in failed]
    sealed = summary.get("failures")
    if isinstance(sealed, list) and sealed:  # a notebook's own seal lists what failed
        return [{"id": str(item)[:120], "status": "failed", "message": ""} for item in sealed]
    cell = summary.get("failed_cell")
    if summary.get("status") != "passed" and cell:
        why = f"{cell.get('ename') or ''}: {cell.get('evalue') or ''}".strip(": ")
        return [
            {
                "id": f"cell {cell.get('index')}",
                "status": summary.get("reason") or summary["status"],
                "message": why.splitlines()[0][:300] if why else "",
            }
        ]
    if summary.get("status") == "error" and summary.get("errors"):
        return [
            {
                "id": "run",
                "status": summary.get("reason") or "error",
                "message": str(summary["errors"][0]).splitlines()[0][:300],
            }
        ]
    return []


# --- many runs ---------------------------------------------------------------


def _from_index(path: Path) -> list[RunEvidence]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable batch index ({exc})") from exc
    if not isinstance(index, dict) or not isinstance(index.get("cells"), list):
        raise ValueError(f"{path}: not a batch index (no 'cells' list)")
    out = []
    for cell in index["cells"]:
        label = (cell.get("tree") or {}).get("label")
        label = None if label == "default" else label
        if cell.get("run_dir"):
            run = load_run(
                path.parent / cell["run_dir"], label=label, env=cell.get("env"), cell=cell
            )
            if run is None:
                run = RunEvidence(
                    folder=path.parent / cell["run_dir"],
                    summary=None,
                    label=label,
                    env=cell.get("env"),
                    cell=cell,
                    integrity=MISSING,
                )
                run.problems.append(
                    f"{run.folder}: listed in {path.name} but holds no summary.json"
                )
        else:
            run = RunEvidence(
                folder=None, summary=None, label=label, env=cell.get("env"), cell=cell
            )
        out.append(run)
    return out


def _scan(runs_dir: Path) -> tuple[list[RunEvidence], list[Path]]:
    """Runs directly under ``runs_dir`` and inside its batch folders (through their index)."""
    found, skipped = [], []
    found += [
        load_notebook(p) for p in sorted(Path(runs_dir).glob("*.ipynb"))
    ]  # downloads, a Drive folder
    for child in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir()):
        if (child / INDEX_FILE).is_file():
            found += _from_index(child / INDEX_FILE)
        elif (run := load_run(child)) is not None:
            found.append(run)
        elif (child / SUMMARY_FILE).is_file():
            skipped.append(child)
    return found, skipped


@dataclass
class Evidence:
    """Runs in order, and what could not be read as a notebook run."""

    runs: list[RunEvidence]
    skipped: list[Path] = field(default_factory=list)

    @property
    def edited(self) -> list[RunEvidence]:
        """Runs whose notebook changed after the run or went missing."""
        return [r for r in self.runs if r.integrity in (EDITED, MISSING)]

    @property
    def warnings(self) -> list[str]:
        return [p for r in self.runs for p in r.problems]

    def rows(self) -> list[dict[str, str]]:
        """One row per run: Tree, Runtime, Result (and Notebook, Environment when runs mix them)."""
        rows = []
        for r in self.runs:
            rows.append(
                {
                    "Tree": r.tree(),
                    "Runtime": r.runtime(),
                    "Result": r.result(),
                    "Notebook": (r.summary or {}).get("notebook")
                    or (r.cell or {}).get("notebook", ""),
                    "Environment": _environment(r),
                }
            )
        return rows

    def columns(self) -> tuple[str, ...]:
        rows = self.rows()
        extra = [
            c for c in ("Notebook", "Environment") if len({row[c] for row in rows if row[c]}) > 1
        ]
        return ("Tree", *extra, "Runtime", "Result")

    def table(self) -> str:
        return tables.markdown(self.rows(), self.columns())

    def markdown(self, relative_to: Path | None = None) -> str:
        """The table, per-id failures, links to the executed notebooks and the warnings."""
        base = Path(relative_to) if relative_to is not None else Path.cwd()
        out = [self.table()]
        failing = [(r, r.failures()) for r in self.runs]
        if any(f for _, f in failing):
            out += ["", "Failures:", ""]
            for run, rows in failing:
                if not rows:
                    continue
                link = _link(run, base, " — ") if run.integrity != UNHASHED else ""
                out.append(f"- {run.tree()} · {run.runtime()}{link}")
                for row in rows:
                    message = f": {row['message']}" if row["message"] else ""
                    out.append(f"  - `{row['id']}` {row['status']}{message}")
        links = [
            f"- {r.tree()} · {r.runtime()}: {_link(r, base)}"
            for r in self.runs
            if r.notebook and r.integrity != UNHASHED
        ]
        if links:
            out += ["", "Executed notebooks:", "", *links]
        if self.warnings:
            out += ["", "Warnings:", "", *(f"- {w}" for w in self.warnings)]
        return "\n".join(out) + "\n"


def _environment(run: RunEvidence) -> str:
    """The batch environment's name, else the interpreter that ran (from the fingerprint)."""
    return run.env or ((run.summary or {}).get("fingerprint") or {}).get("executable") or ""


def _link(run: RunEvidence, base: Path, prefix: str = "") -> str:
    path = run.notebook
    if path is None:
        return ""
    rel = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
    flag = f" **{run.integrity}**" if run.integrity in (EDITED, MISSING) else ""
    name = path.name if run.bare is not None else f"{path.parent.name}/{path.name}"
    return f"{prefix}[{name}]({rel}){flag}"


def collect(
    runs: Iterable[Path] = (), batches: Iterable[Path] = (), folders: Iterable[Path] = ()
) -> Evidence:
    """Runs from runs dirs (scanned, batch folders through their index), batch index files and
    explicit run folders; each run once (first seen wins). ValueError for an unusable argument."""
    found: list[RunEvidence] = []
    skipped: list[Path] = []
    for index in batches:
        index = Path(index)
        if index.is_dir():
            index = index / INDEX_FILE
        if not index.is_file():
            raise ValueError(f"{index}: no such batch index")
        found += _from_index(index)
    for runs_dir in runs:
        if not Path(runs_dir).is_dir():
            raise ValueError(f"{runs_dir}: not a folder of runs")
        more, skip = _scan(Path(runs_dir))
        found += more
        skipped += skip
    for folder in folders:
        folder = Path(folder)
        if folder.suffix == ".ipynb" and folder.is_file():
            found.append(load_notebook(folder))
            continue
        run = load_run(folder)
        if run is None and folder.is_dir() and any(folder.glob("*.ipynb")):
            found += [load_notebook(p) for p in sorted(folder.glob("*.ipynb"))]
            continue
        if run is None:
            raise ValueError(
                f"{folder}: no notebook run (summary.json) and no executed notebook (.ipynb) there"
            )
        found.append(run)
    unique: list[RunEvidence] = []
    seen: set[Path] = set()
    for run in found:
        key = (run.bare or run.folder).resolve() if run.folder is not None else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        unique.append(run)
    return Evidence(runs=unique, skipped=skipped)
