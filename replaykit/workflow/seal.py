"""Bind a run's verdict to its executed notebook, so that neither can be edited unnoticed.

Two seals, one concept:

* **the runner's** (papermill, ``runs.run_notebook``): the verdict and a sha256 of the whole
  ``summary.json`` go into the notebook's metadata (``metadata.replaykit``), then the sealed
  notebook's sha256 into the summary. Evidence checks both ways.
* **the notebook's own** (``finish``, its last cell; what a notebook run by hand or in Colab
  leaves): an output of type ``SEAL_MIME`` holding the verdict, counts, parameters, fingerprint,
  the sha256 of every cell the kernel executed, a digest of every execution's outputs (recorded
  in the kernel as they were sent: ``outputs``), and a digest over all of it, beside a visible
  summary. A downloaded ``.ipynb`` is evidence on its own: ``check_notebook`` refuses an edited
  seal, a cell whose source or outputs changed after it ran, a seal whose visible summary is not
  the one its body renders, a cell run after the seal, and a pass beside a failed cell.

What the output digests cover, exactly: every execution after the one that started the recorder
(the bootstrap cell: its fetch and install lines are not a result) up to the seal's own, and in
the seal's cell the outputs before the seal; what the seal cell prints after it (the download
line, the final assert) is not covered, and the seal's visible texts are checked against its body.
(A digest is not a signature: it shows an edit, not who may make one.)
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from . import outputs as _outputs
from .bootstrap import file_sha256, in_colab
from .verdict import result_text, runtime_text, skipped, status_text, tree_text

__all__ = [
    "KEY",
    "SEAL_MIME",
    "VERDICT_KEYS",
    "cells_failed",
    "check",
    "check_notebook",
    "finish",
    "notebook_seal",
    "read",
    "run_folder",
    "seal",
    "summary_digest",
]

KEY = "replaykit"
VERDICT_KEYS = ("status", "reason", "failed_cell", "errors", "counts", "results")
"""What the Result column and the failure list are made of: sealed into the notebook."""


def _normal(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as summary.json stores it (JSON types only)."""
    return json.loads(json.dumps(summary, default=str))


def summary_digest(summary: dict[str, Any]) -> str:
    """sha256 of the summary without its ``sha256`` entry (which hashes the sealed notebook)."""
    body = {k: v for k, v in _normal(summary).items() if k != "sha256"}
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def seal(notebook: Path, summary: dict[str, Any]) -> None:
    """Write the verdict and the summary's digest into ``notebook``; set ``summary["sha256"]`` to
    the sealed file's hash. Call it last: any later change to either side breaks the seal."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    normal = _normal(summary)
    nb.metadata[KEY] = {
        "summary_sha256": summary_digest(summary),
        "verdict": {k: normal.get(k) for k in VERDICT_KEYS},
    }
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
        changed = [
            k
            for k in VERDICT_KEYS
            if isinstance(verdict, dict) and verdict.get(k) != _normal(summary).get(k)
        ]
        what = f" ({', '.join(changed)} differ from the notebook's)" if changed else ""
        problems.append(f"{notebook.parent / 'summary.json'}: EDITED after the run{what}")
    status = (verdict or summary).get("status")
    if status == "passed" and cells_failed(nb):
        problems.append(f"{notebook}: a cell failed, but the run is recorded as passed")
    return (verdict if isinstance(verdict, dict) else None), problems


# --- the notebook's own seal: its last cell --------------------------------------------------

SEAL_MIME = "application/vnd.replaykit.seal+json"
"""The output type of the seal the last cell displays (kept in the saved notebook)."""
SEAL_FILE = "seal.json"
SCHEMA = 2
"""2: the seal covers outputs (``outputs``) and its own visible texts; 1 covered sources only."""
RUNS_ENV = "REPLAYKIT_RUNS_DIR"
"""Where a notebook run without the runner writes its run folder (Colab: ``runs/`` here)."""


def _finite(value: Any) -> Any:
    """JSON types with NaN and infinities as strings: a notebook's JSON output has no NaN, so a
    digest over them would not survive the round trip through the saved notebook."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(_normal(body), sort_keys=True, separators=(",", ":")).encode()


def _source_digest(source: str) -> str:
    """sha256 of a cell's source, trailing blanks ignored (front ends differ there)."""
    text = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return hashlib.sha256(text.encode()).hexdigest()


def _executed(shell: Any) -> list[str]:
    """The sources the kernel executed, in order (``In[1]`` ...), this cell included."""
    return list(shell.history_manager.input_hist_raw[1:]) if shell is not None else []


def parameters_of(sources: list[str]) -> dict[str, Any]:
    """The values of the parameters cell (and a runner's injected one after it), as written: the
    executed cells whose source starts with ``# Parameters``; later assignments win."""
    import ast

    params: dict[str, Any] = {}
    for source in sources:
        if not source.lstrip().startswith("# Parameters"):
            continue
        for node in ast.parse(source).body:
            target = (
                node.target
                if isinstance(node, ast.AnnAssign)
                else (node.targets[0] if isinstance(node, ast.Assign) else None)
            )
            if isinstance(target, ast.Name) and node.value is not None:
                try:
                    params[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    params[target.id] = ast.unparse(node.value)
    return params


def run_folder(run_dir: str | None, fp: dict[str, Any]) -> str:
    """Where this run's files go: the runner's ``run_dir``; else, in Colab (or with
    ``REPLAYKIT_RUNS_DIR`` set), a new ``runs/<UTC>_<device>_torch<ver>_<tree>`` folder; else ``""``
    (a notebook opened by hand: its seal is in the notebook)."""
    if run_dir:
        return str(run_dir)
    parent = os.environ.get(RUNS_ENV) or (str(Path.cwd() / "runs") if in_colab() else "")
    if not parent:
        return ""
    from .fingerprint import FINGERPRINT_FILE, fingerprint_slug
    from .folders import unique_folder

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = unique_folder(Path(parent), f"{stamp}_{fingerprint_slug(fp)}")
    (folder / FINGERPRINT_FILE).write_text(json.dumps(fp, indent=1, default=str) + "\n")
    return str(folder)


def notebook_seal(
    notebook: str,
    results: dict[str, Any],
    failures: list[str],
    fp: dict[str, Any],
    *,
    ok: bool | None = None,
    reason: str | None = None,
    shell: Any = None,
) -> dict[str, Any]:
    """The seal's body and digest: verdict, counts, parameters, fingerprint, executed cells."""
    executed = _executed(shell)
    passed = (not failures) if ok is None else ok
    body = {
        "schema": SCHEMA,
        "notebook": notebook,
        "status": "passed" if passed else "failed",
        "reason": None if passed else (reason or "exception"),
        "failures": list(failures),
        "results": results,
        "counts": results.get("counts") if isinstance(results, dict) else None,
        "parameters": parameters_of(executed),
        "fingerprint": fp,
        "executed": [_source_digest(s) for s in executed],
        "outputs": _outputs.covered(shell) if shell is not None else {"from": None, "digests": []},
        "sealed_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    body = _finite(_normal(body))
    body["result"] = result_text(body)
    body["skipped"] = skipped(body)
    return body | {"digest": hashlib.sha256(_canonical(body)).hexdigest()}


def _markdown(sealed: dict[str, Any]) -> str:
    fp = sealed.get("fingerprint") or {}
    lines = [
        f"**replaykit verdict: {status_text(sealed)}** — {sealed['result']}",
        "",
        f"`{sealed['notebook']}` · tree {tree_text(fp.get('tree') or {})} · {runtime_text(fp)} · "
        f"{len(sealed['executed'])} cells executed{_covered_text(sealed)} · sealed {sealed['sealed_utc']} · digest `{sealed['digest'][:16]}`",
    ]
    lines += [f"- failed: {f}" for f in sealed["failures"][:20]]
    return "\n".join(lines)


def _covered_text(sealed: dict[str, Any]) -> str:
    first = (sealed.get("outputs") or {}).get("from")
    if not isinstance(first, int) or first > len(sealed["executed"]):
        return " (no outputs sealed)"
    return f" (outputs sealed from In[{first}])"


def finish(
    notebook: str,
    results: dict[str, Any],
    failures: list[str],
    fp: dict[str, Any],
    out_dir: str = "",
    *,
    ok: bool | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """A notebook's last cell: seal the verdict into the notebook (an output: File > Download keeps
    it), save it in ``out_dir`` beside results.json, and in Colab offer that folder as one download.
    Returns the seal; raising on failures is the cell's job, after this."""
    from IPython import get_ipython
    from IPython.display import display

    sealed = notebook_seal(
        notebook, results, failures, fp, ok=ok, reason=reason, shell=get_ipython()
    )
    display(
        {SEAL_MIME: sealed, "text/markdown": _markdown(sealed), "text/plain": sealed["result"]},
        raw=True,
    )
    if out_dir:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        (folder / SEAL_FILE).write_text(json.dumps(sealed, indent=1) + "\n")
        if in_colab():
            from google.colab import files  # type: ignore[import-not-found]

            zipped = shutil.make_archive(
                str(folder), "zip", root_dir=folder.parent, base_dir=folder.name
            )
            print(
                f"run folder {folder} -> {Path(zipped).name} (download offered); save this notebook with File > Download"
            )
            files.download(zipped)
    return sealed


def _seal_output(nb: Any) -> tuple[int, int, dict[str, Any], dict[str, Any]] | None:
    """(cell index, output index, seal, the output's data) of the last seal output, or None."""
    found = None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for position, out in enumerate(cell.get("outputs", [])):
            shown = out.get("output_type") in ("display_data", "execute_result")
            data = dict(out.get("data", {})) if shown else {}
            if SEAL_MIME in data:
                value = data[SEAL_MIME]
                sealed = json.loads(value) if isinstance(value, str) else dict(value)
                found = (index, position, sealed, data)
    return found


def find_seal(nb: Any) -> tuple[int, dict[str, Any]] | None:
    """(cell index, seal) of the last seal output in an executed notebook, or None."""
    found = _seal_output(nb)
    return None if found is None else (found[0], found[2])


def _shown_as_sealed(
    path: Path, index: int, sealed: dict[str, Any], data: dict[str, Any]
) -> list[str]:
    """The seal output's visible texts are the ones its body renders, and it shows nothing else."""
    expected = {SEAL_MIME, "text/markdown", "text/plain"}
    problems = []
    if set(data) - expected:
        extra = ", ".join(sorted(set(data) - expected))
        problems.append(f"{path}: the seal (cell {index}) shows {extra} it never wrote: EDITED")
    try:
        rendered = {"text/markdown": _markdown(sealed), "text/plain": sealed["result"]}
    except (KeyError, TypeError):
        return [*problems, f"{path}: the seal (cell {index}) is incomplete: EDITED"]
    for mime, want in rendered.items():
        if _outputs.text(data.get(mime, "")) != _outputs.text(want):
            problems.append(
                f"{path}: the seal's {mime} (cell {index}) was EDITED: it is not what the seal says"
            )
    return problems


def _outputs_as_sealed(
    path: Path, nb: Any, sealed: dict[str, Any], seal_at: tuple[int, int]
) -> list[str]:
    """Each covered execution's outputs (as saved) against the digest the kernel recorded."""
    cover = sealed.get("outputs") or {}
    first, digests = cover.get("from"), cover.get("digests") or []
    if not isinstance(first, int):
        return []
    problems = []
    for i, cell in enumerate(nb.cells):
        count = cell.get("execution_count") if cell.cell_type == "code" else None
        if not isinstance(count, int) or not first <= count < first + len(digests):
            continue
        outs = list(cell.get("outputs", []))
        if i == seal_at[0]:
            outs = outs[: seal_at[1]]  # the seal's own cell: what it showed before the seal
        if _outputs.digest(outs) != digests[count - first]:
            problems.append(
                f"{path}: cell {i}'s outputs were EDITED after it ran (not what execution {count} showed)"
            )
    return problems


def _sources_as_executed(path: Path, nb: Any, executed: list[str]) -> list[str]:
    problems = []
    for i, cell in enumerate(nb.cells):
        count = cell.get("execution_count") if cell.cell_type == "code" else None
        if not isinstance(count, int):
            continue  # never run
        if count > len(executed):
            problems.append(
                f"{path}: cell {i} ran after the seal (execution {count}): its outputs are not evidence"
            )
        elif executed[count - 1] != _source_digest(cell.source):
            problems.append(
                f"{path}: cell {i} was EDITED after it ran (its source is not what execution {count} ran)"
            )
    return problems


def check_notebook(path: Path) -> tuple[dict[str, Any] | None, list[str], Any]:
    """(the notebook's own seal or None, problems, the notebook). A problem: a seal whose digest
    does not match (edited), a code cell whose source or outputs differ from what the kernel
    executed and showed, a seal whose visible texts are not its own, a cell run after the seal,
    a pass beside a failed cell. ValueError when the file is no notebook."""
    _, nb = read(path)
    found = _seal_output(nb)
    if found is None:
        return None, [], nb
    index, position, sealed, data = found
    problems: list[str] = []
    body = {k: v for k, v in sealed.items() if k != "digest"}
    if hashlib.sha256(_canonical(body)).hexdigest() != sealed.get("digest"):
        problems.append(
            f"{path}: the seal (cell {index}) was EDITED after the run: its digest does not match"
        )
    problems += _sources_as_executed(path, nb, sealed.get("executed") or [])
    if int(sealed.get("schema") or 1) >= 2:  # schema 1 sealed sources only
        problems += _shown_as_sealed(path, index, sealed, data)
        problems += _outputs_as_sealed(path, nb, sealed, (index, position))
    if sealed.get("status") == "passed" and cells_failed(nb):
        problems.append(f"{path}: a cell failed, but the seal says passed")
    return sealed, problems, nb
