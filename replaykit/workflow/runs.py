# One module: a run's kernel, execution and summary.json are one contract with the notebooks (see below).
"""Run one notebook through papermill and save it as evidence.

``run_notebook`` executes a notebook into ``runs/<UTC time>_<device>_torch<ver>_<tree>/``
with ``summary.json`` beside it. The executed notebook is kept also when a cell
raises, times out or the kernel dies, and the summary says which cell and why. The
summary is sealed into the notebook's metadata (``replaykit.workflow.seal``), so evidence
can tell when either file was edited after the run.

Contract with notebooks: the runner injects a ``run_dir`` parameter (an absolute
path). A notebook may write ``fingerprint.json`` there (preferred over the
runner's own fingerprint) and ``results.json`` (merged into the summary under
``results``; its ``counts`` entry is shown on the summary line).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaykit.workflow.fingerprint import FINGERPRINT_FILE, fingerprint, fingerprint_slug, torch_of

from .bootstrap import file_sha256
from .errors import RunInterrupted
from .folders import SUMMARY_FILE, unique_folder
from .seal import seal
from .verdict import result_text, status_text

RESULTS_FILE = "results.json"
SCHEMA = 1
TIMEOUT_ENAME = "CellTimeoutError"
_MARKER_TAGS = ("injected-parameters", "papermill-error-cell-tag")


@dataclass
class RunResult:
    """Where a run was saved and how it ended."""

    run_dir: Path
    notebook: Path
    summary: dict[str, Any]
    ok: bool


# --- kernel -----------------------------------------------------------------


def default_kernel_name() -> str:
    """``replaykit-<hash of sys.executable>``: one kernelspec per interpreter."""
    digest = hashlib.sha1(os.path.abspath(sys.executable).encode()).hexdigest()[:8]
    return f"replaykit-{digest}"


def kernel_executable(name: str) -> str | None:
    """The interpreter a kernelspec launches (its ``argv[0]``), or None when not installed."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv = KernelSpecManager().get_kernel_spec(name).argv
    except NoSuchKernel:
        return None
    return argv[0] if argv else None


def ensure_kernel(name: str | None = None) -> str:
    """Register the current interpreter as kernelspec ``name`` unless it already is; return the name.

    Same as ``python -m ipykernel install --sys-prefix --name NAME`` (``--user`` when
    ``sys.prefix`` is read-only). Papermill otherwise takes whatever ``python3`` spec
    is installed, which may run another environment.
    """
    name = name or default_kernel_name()
    here = os.path.abspath(sys.executable)
    if kernel_executable(name) == here:
        return name
    from ipykernel.kernelspec import install

    display = f"Python {sys.version_info[0]}.{sys.version_info[1]} ({name}: {sys.prefix})"
    try:
        install(kernel_name=name, display_name=display, prefix=sys.prefix, frozen_modules=True)
    except OSError:
        install(kernel_name=name, display_name=display, user=True, frozen_modules=True)
    found = kernel_executable(name)
    if found != here:
        raise RuntimeError(
            f"kernelspec {name!r} launches {found}, not {here}: another spec of that name "
            "shadows it (see `jupyter kernelspec list`); pass another kernel name"
        )
    return name


# --- helpers for notebooks --------------------------------------------------


def write_results(run_dir: str | Path | None, results: dict[str, Any]) -> None:
    """Write ``results.json`` into ``run_dir`` (no-op when None); put pass/fail tallies under ``counts``."""
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / RESULTS_FILE).write_text(json.dumps(results, indent=1, default=str) + "\n")


# --- parameters from a command line -----------------------------------------


_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "list": (list,),
    "dict": (dict,),
}


def declared_parameters(notebook: Path) -> dict[str, str]:
    """Name -> declared type name (``"bool"``, ``"list"``, ``"None"`` when untyped) of the
    assignments in ``notebook``'s cells tagged ``parameters``."""
    import nbformat
    from papermill.translators import PythonTranslator

    cells = [
        c
        for c in nbformat.read(str(notebook), as_version=4).cells
        if "parameters" in c.metadata.get("tags", [])
    ]
    return {p.name: p.inferred_type_name for cell in cells for p in PythonTranslator.inspect(cell)}


def check_parameters(notebook: Path, params: dict[str, Any]) -> None:
    """Refuse, before anything runs, a parameter the notebook does not declare (ValueError, with
    the declared names) or whose value does not match its declared type (TypeError).

    papermill only warns about an unknown name and runs with the defaults: ``-p marker ""`` would
    keep ``markers="cuda"`` and report a pass. ``-p quick false`` would inject the truthy ``"false"``.
    """
    declared = declared_parameters(notebook)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise ValueError(
            f"{Path(notebook).name} declares no parameter {', '.join(map(repr, unknown))}; "
            f"it declares: {', '.join(declared) or '(none)'}"
        )
    for name, value in params.items():
        kind = declared.get(name, "")
        allowed = _TYPES.get(kind)
        if allowed is None or value is None:
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise TypeError(
                f"parameter {name!r} of {Path(notebook).name} is declared {kind}; got {value!r} ({type(value).__name__})"
            )


check_parameter_types = check_parameters  # the former name


def cli_value(text: str) -> Any:
    """Convert a ``-p`` value as papermill's CLI does (True/False/None, int, float, else str),
    accepting true/false/none in any case too."""
    if text.lower() in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cli_parameters(
    pairs: list[list[str]] | None = None,
    raw: list[list[str]] | None = None,
    yamls: list[str] | None = None,
) -> dict[str, Any]:
    """Merge ``-y`` (YAML/JSON text or a file holding it), then ``-p`` (converted), then ``-r`` (strings)."""
    import yaml

    params: dict[str, Any] = {}
    for item in yamls or []:
        if not Path(item).is_file() and re.fullmatch(r"[\w.~/-]+\.(ya?ml|json)", item.strip()):
            raise ValueError(f"-y {item!r}: no such file")  # not read as YAML text naming a file
        text = Path(item).read_text() if Path(item).is_file() else item
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(
                f"-y {_clip(item, 60)!r}: not valid YAML/JSON ({_yaml_problem(exc)})"
            ) from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"-y {item!r}: not a file, and not a YAML/JSON mapping (got {type(loaded).__name__})"
            )
        params |= loaded
    params |= {name: cli_value(value) for name, value in pairs or []}
    params |= {name: value for name, value in raw or []}
    return params


def _yaml_problem(exc: Exception) -> str:
    """``expected ',' or '}' at line 1, column 12``: what went wrong and where, on one line."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return (
        f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
        if mark is not None
        else problem
    )


def _clip(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters; a long one keeps its head and its tail
    (an exception's useful half is often at the end)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]} … {text[-(limit - 3 - half) :]}"


# --- running ----------------------------------------------------------------


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _jsonable(value: Any, where: str) -> Any:
    """Parameters as papermill's Python API needs them: JSON types (Path -> str, tuple -> list)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"parameter {where}: dict keys must be str")
        return {k: _jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"parameter {where}: {type(value).__name__} is not a JSON type")


def _make_run_dir(runs_dir: Path, stamp: str, slug: str) -> Path:
    return unique_folder(runs_dir, f"{stamp}_{slug}")


def _read_json(path: Path) -> tuple[Any, str | None]:
    if not path.is_file():
        return None, None
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as exc:
        return None, f"{path.name}: {exc}"


def _pm(cell: Any) -> dict[str, Any]:
    return dict(cell.get("metadata", {}).get("papermill", {}))


def _tags(cell: Any) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _error_output(cell: Any) -> dict[str, Any] | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out
    return None


def _cell_table(nb: Any, source_has_injected: bool) -> list[dict[str, Any]]:
    """Per code cell: index in the executed notebook, index in the input notebook, status, duration."""
    rows, source_index = [], 0
    for index, cell in enumerate(nb.cells):
        tags = _tags(cell)
        if "papermill-error-cell-tag" in tags:
            continue
        injected = "injected-parameters" in tags
        src = None if injected and not source_has_injected else source_index
        if src is not None:
            source_index += 1
        if cell.cell_type != "code":
            continue
        pm = _pm(cell)
        rows.append(
            {
                "index": index,
                "source_index": src,
                "execution_count": cell.get("execution_count"),
                "status": pm.get("status"),
                "duration": pm.get("duration"),
            }
        )
    return rows


def _failed_cell(nb: Any, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first cell marked failed or holding an error output (execution stops there)."""
    for row in rows:
        cell = nb.cells[row["index"]]
        err = _error_output(cell)
        if row["status"] != "failed" and err is None:
            continue
        source = cell.source.strip().splitlines()
        return row | {
            "papermill": _pm(cell),
            "ename": err.get("ename") if err else None,
            "evalue": err.get("evalue") if err else None,
            "source_head": source[0][:200] if source else "",
        }
    return None


def _repair(nb: Any, exc: BaseException) -> None:
    """Make metadata truthful after papermill raised outside a cell error.

    On a dead kernel or runner error papermill marks the running cell and every
    cell after it ``completed``. Mark the last started cell failed (with an
    error output naming the exception) and the never-started ones pending.
    """
    import nbformat

    started = [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and _pm(c).get("start_time")
    ]
    for i, cell in enumerate(nb.cells):
        pm = cell.get("metadata", {}).get("papermill")
        if pm is None:
            continue
        if started and i == started[-1]:
            pm.update(status="failed", exception=True)
            cell.outputs.append(
                nbformat.v4.new_output(
                    "error", ename=type(exc).__name__, evalue=str(exc)[:2000], traceback=[]
                )
            )
        elif not pm.get("start_time"):
            pm.update(status="pending", end_time=None, duration=None)
    nb.metadata.setdefault("papermill", {})["exception"] = True


def _classify(exc: BaseException | None, timed_out: bool) -> tuple[str, str | None]:
    """(status, reason) from how papermill ended."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    if exc is None:
        return "passed", None
    if timed_out or isinstance(exc, CellTimeoutError):
        return "failed", "timeout"
    if isinstance(exc, PapermillExecutionError):
        return "failed", "exception"
    if isinstance(exc, DeadKernelError):
        return "error", "kernel_died"
    if isinstance(exc, KeyboardInterrupt):
        return "error", "interrupted"
    return "error", "runner_error"


def _is_cell_error(exc: BaseException) -> bool:
    """True when papermill itself recorded the failure (a cell error, timeouts included)."""
    from papermill.exceptions import PapermillExecutionError

    return isinstance(exc, PapermillExecutionError)


def _has_parameters_cell(nb: Any) -> bool:
    return any("parameters" in _tags(c) for c in nb.cells)


_torch_memo: dict[str, dict[str, Any] | None] | None = None
"""Each kernel interpreter's ``torch_of`` while :func:`torch_asked_once` is active, else None."""


@contextlib.contextmanager
def torch_asked_once() -> Iterator[None]:
    """Within: each kernel interpreter's torch and device are asked once, not per run (``torch_of``
    imports torch in a subprocess: 1-2 s a run). For a batch: a run never installs torch (the
    bootstraps keep it), so an environment's torch does not change between its cells."""
    global _torch_memo
    outer, _torch_memo = _torch_memo, {} if _torch_memo is None else _torch_memo
    try:
        yield
    finally:
        _torch_memo = outer


def folder_fingerprint(runner_fp: dict[str, Any], kernel: str) -> dict[str, Any]:
    """The fingerprint a run folder is named after: the runner's, with torch and device of the
    kernel's interpreter when that is another one (a batch environment: its torch, not the runner's)."""
    python = kernel_executable(kernel)
    if not python or os.path.abspath(python) == os.path.abspath(sys.executable):
        return runner_fp
    if _torch_memo is None:
        other = torch_of(python)
    else:
        key = os.path.abspath(python)
        if key not in _torch_memo:
            _torch_memo[key] = torch_of(python)
        other = _torch_memo[key]
    return {**runner_fp, **other} if other else runner_fp


def run_notebook(
    notebook: Path,
    parameters: dict[str, Any] | None = None,
    runs_dir: Path = Path("runs"),
    kernel_name: str | None = None,
    cell_timeout: int | None = None,
    progress: bool = True,
    tree: Path | None = None,
    cwd: Path | None = None,
) -> RunResult:
    """Execute ``notebook`` with ``parameters`` into a new run folder under ``runs_dir``.

    Raises FileNotFoundError (no notebook), ValueError (no cell tagged ``parameters``,
    or ``run_dir`` passed by the caller), TypeError (a parameter that is not JSON).
    Everything that goes wrong while it runs ends up in the summary instead.
    ``kernel_name`` None registers and uses this interpreter (``ensure_kernel``);
    ``cell_timeout`` interrupts a cell after that many seconds; ``tree`` is the tree
    whose commit the fingerprint records; ``cwd`` is the kernel's working directory.
    """
    import nbformat
    import papermill as pm

    notebook = Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"notebook not found: {notebook}")
    source_nb = nbformat.read(notebook, as_version=4)
    if not _has_parameters_cell(source_nb):
        raise ValueError(f"{notebook} has no cell tagged 'parameters'; papermill would only warn")
    params = _jsonable(dict(parameters or {}), "parameters")
    check_parameters(notebook, params)
    if "run_dir" in params:
        raise ValueError("'run_dir' is set by the runner; do not pass it")
    kernel = kernel_name or ensure_kernel()
    language = (
        source_nb.metadata.get("kernelspec", {}).get("language")
        or source_nb.metadata.get("language_info", {}).get("name")
        or "python"
    )

    runner_fp = fingerprint(tree)
    started = _utcnow()
    run_dir = _make_run_dir(
        Path(runs_dir),
        started.strftime("%Y%m%dT%H%M%SZ"),
        fingerprint_slug(folder_fingerprint(runner_fp, kernel)),
    )
    out_path = run_dir / f"{notebook.stem}.ipynb"
    params["run_dir"] = str(run_dir.resolve())

    timed_out: list[int] = []

    def on_cell_error(cell: Any, cell_index: int, execute_reply: dict[str, Any]) -> None:
        if execute_reply.get("content", {}).get("ename") == TIMEOUT_ENAME:
            timed_out.append(cell_index)
            note = f"replaykit runner: cell timed out after {cell_timeout} s; kernel interrupted\n"
            cell.outputs.append(nbformat.v4.new_output("stream", name="stderr", text=note))

    # The kernel's log at CRITICAL: its "running over TCP without encryption" warning is not printed
    # on every run, nor the ZMQ tracebacks of a kernel shut down by Ctrl-C (the notebook holds what ran).
    engine_kwargs: dict[str, Any] = {
        "on_cell_error": on_cell_error,
        "extra_arguments": ["--IPKernelApp.log_level=CRITICAL"],
    }
    if cell_timeout:
        # Interrupt instead of raising: papermill then marks the cell failed and later cells
        # pending. error_on_timeout ends the wait even when the kernel ignores the interrupt.
        engine_kwargs |= {
            "execution_timeout": cell_timeout,
            "interrupt_on_timeout": True,
            "error_on_timeout": {
                "ename": TIMEOUT_ENAME,
                "evalue": f"cell timed out after {cell_timeout} s; the kernel was interrupted",
                "traceback": [],
            },
        }

    exc: BaseException | None = None
    t0 = time.monotonic()
    try:
        pm.execute_notebook(
            str(notebook.resolve()),  # absolute: papermill writes from inside `cwd`
            str(out_path.resolve()),
            parameters=params,
            kernel_name=kernel,
            language=language,
            request_save_on_cell_execute=True,
            progress_bar=progress,
            log_output=False,
            cwd=str(cwd) if cwd is not None else None,
            **engine_kwargs,
        )
    except BaseException as e:  # saved below; KeyboardInterrupt re-raised after saving
        exc = e
    duration = time.monotonic() - t0
    ended = _utcnow()

    status, reason = _classify(exc, bool(timed_out))
    nb = nbformat.read(out_path, as_version=4) if out_path.is_file() else None
    if nb is not None and exc is not None and not _is_cell_error(exc):
        _repair(nb, exc)
        nbformat.write(nb, out_path)
    if (
        nb is not None
        and status == "passed"
        and any(r["status"] == "failed" for r in _cell_table(nb, False))
    ):
        status, reason = "failed", "exception"  # e.g. sys.exit(0) stops the notebook silently

    summary = _summarise(
        notebook=notebook,
        nb=nb,
        source_has_injected=any("injected-parameters" in _tags(c) for c in source_nb.cells),
        status=status,
        reason=reason,
        exc=exc,
        timed_out=bool(timed_out),
        params=params,
        kernel=kernel,
        cell_timeout=cell_timeout,
        started=started,
        ended=ended,
        duration=duration,
        runner_fp=runner_fp,
        run_dir=run_dir,
        out_path=out_path,
    )
    if out_path.is_file():
        seal(out_path, summary)  # last: from here on, neither file can be edited alone
    tmp = run_dir / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(run_dir / SUMMARY_FILE)
    if isinstance(exc, KeyboardInterrupt):
        raise RunInterrupted(run_dir, out_path) from None
    return RunResult(run_dir=run_dir, notebook=out_path, summary=summary, ok=status == "passed")


def _summarise(
    *,
    notebook: Path,
    nb: Any,
    source_has_injected: bool,
    status: str,
    reason: str | None,
    exc: BaseException | None,
    timed_out: bool,
    params: dict[str, Any],
    kernel: str,
    cell_timeout: int | None,
    started: _dt.datetime,
    ended: _dt.datetime,
    duration: float,
    runner_fp: dict[str, Any],
    run_dir: Path,
    out_path: Path,
) -> dict[str, Any]:
    rows = _cell_table(nb, source_has_injected) if nb is not None else []
    failed = _failed_cell(nb, rows) if nb is not None else None
    if failed is not None and timed_out:
        failed |= {"kernel_ename": failed["ename"], "ename": TIMEOUT_ENAME}
        failed["evalue"] = f"cell timed out after {cell_timeout} s; the kernel was interrupted"
    elif failed is not None and failed["ename"] is None and exc is not None:
        failed |= {"ename": type(exc).__name__, "evalue": str(exc)[:2000]}

    nb_fp, fp_error = _read_json(run_dir / FINGERPRINT_FILE)
    results, results_error = _read_json(run_dir / RESULTS_FILE)
    counts = results.get("counts") if isinstance(results, dict) else None
    errors = [e for e in (fp_error, results_error) if e]
    if exc is not None and failed is None:
        errors.insert(0, f"{type(exc).__name__}: {str(exc)[:2000]}")
    return {
        "schema": SCHEMA,
        "notebook": notebook.name,
        "input_path": str(notebook.resolve()),
        "run_dir": str(run_dir),
        "output": out_path.name,
        "sha256": file_sha256(out_path) if out_path.is_file() else None,
        "status": status,
        "reason": reason,
        "failed_cell": failed,
        "errors": errors,
        "parameters": params,
        "kernel": kernel,
        "kernel_executable": kernel_executable(kernel),
        "cell_timeout": cell_timeout,
        "started_utc": started.isoformat(timespec="seconds"),
        "ended_utc": ended.isoformat(timespec="seconds"),
        "duration_s": round(duration, 3),
        "cells": rows,
        "fingerprint": nb_fp if isinstance(nb_fp, dict) else runner_fp,
        "fingerprint_source": "notebook" if isinstance(nb_fp, dict) else "runner",
        "runner_fingerprint": runner_fp,
        "results": results,
        "counts": counts,
    }


def summary_line(summary: dict[str, Any]) -> str:
    """One line: status, notebook, failing cell and why (head and tail of the error), counts,
    duration, and for a run that did not pass, where to look (the executed notebook)."""
    parts = [status_text(summary), summary["notebook"]]
    cell = summary.get("failed_cell")
    if cell:
        where = f"cell {cell['index']}"
        if cell.get("source_index") is not None:
            where += f" (source cell {cell['source_index']})"
        why = f"{cell.get('ename')}: {cell.get('evalue') or ''}".strip().rstrip(":")
        parts.append(f"{where} {summary.get('reason')}: {_clip(why, 300)}")
    elif summary.get("errors"):
        parts.append(f"{summary.get('reason')}: {_clip(str(summary['errors'][0]), 300)}")
    counts = summary.get("counts")
    if isinstance(counts, dict):
        parts.append("counts " + " ".join(f"{k}={v}" for k, v in counts.items()))
    elif counts is not None:
        parts.append(f"counts {counts}")
    elif isinstance(summary.get("results"), dict) and (text := result_text(summary)):
        parts.append(text)  # parity, hazards, benchmark: their parts, skipped rows apart
    parts.append(f"{summary['duration_s']:.1f} s")
    if summary["status"] != "passed" and summary.get("run_dir"):
        parts.append(f"see {Path(summary['run_dir']) / summary.get('output', '')}")
    return " | ".join(parts)
