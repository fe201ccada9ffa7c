"""Run a matrix of environments × trees × notebooks × parameter sets; one index per batch.

    spec = load_spec("batch.json")            # or BatchSpec(...)
    result = run_batch(spec, Path("runs"))    # runs/batch_<UTC>_<name>/index.json + index.md

This module is the plan (``BatchSpec``, read from JSON or YAML) and the runner; each part of a
cell lives in a module named for it: ``environments`` (an existing interpreter, or a venv built
from requirements), ``kernels`` (a kernelspec per environment, private to the batch, so no
installed ``python3`` spec can stand in for it), ``trees`` (a folder, an archive, or a git
revision packed and unpacked so the notebook sees exactly that commit), ``cells`` (one run, and
the check that it ran the environment's interpreter: else "wrong interpreter") and ``index``.
A cell that fails, dies or cannot start is recorded and the batch goes on.
"""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from replaykit.workflow import tables
from replaykit.workflow.cells import (
    WRONG_INTERPRETER,
    declares,
    error_cell,
    interpreter_problem,
    run_cell,
)
from replaykit.workflow.environments import (
    EnvBuildError,
    Environment,
    build_venv,
    default_venvs_dir,
)
from replaykit.workflow.errors import WorkflowError
from replaykit.workflow.index import INDEX_COLUMNS, index_rows, new_folder, write_index
from replaykit.workflow.interpreters import probe, same_interpreter
from replaykit.workflow.kernels import jupyter_path, kernel_name, register_kernel
from replaykit.workflow.runs import check_parameters, torch_asked_once
from replaykit.workflow.trees import DEFAULT_TREE, PreparedTree, TreeSpec, prepare_tree

__all__ = ["ENV_FAILED", "BatchResult", "BatchSpec", "load_spec", "run_batch"]
# Kept importable from here (they lived in this module before it was split by concern):
__all__ += [
    "WRONG_INTERPRETER",
    "EnvBuildError",
    "Environment",
    "PreparedTree",
    "TreeSpec",
    "build_venv",
    "declares",
    "error_cell",
    "index_rows",
    "interpreter_problem",
    "kernel_name",
    "new_folder",
    "prepare_tree",
    "register_kernel",
    "run_cell",
    "same_interpreter",
    "write_index",
]

ENV_FAILED = "env build failed"


def _utc() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


# --- the plan ----------------------------------------------------------------


@dataclass
class BatchSpec:
    """environments × trees × notebooks × parameter sets. Relative paths are taken from the cwd.

    No ``trees``: each notebook runs on its own default tree (nothing injected). With trees,
    a notebook that declares a ``tree`` parameter gets the tree's folder there; one that does
    not runs with the tree as its working directory.

    ``notebook_parameters`` gives a notebook its own parameter sets instead of ``parameters``
    (in a spec file: a notebook entry ``{"path": ..., "parameters": [...]}``), so notebooks
    that declare different parameters share one batch.
    """

    environments: list[Environment]
    notebooks: list[str]
    trees: list[TreeSpec] = field(default_factory=list)
    parameters: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    name: str = "batch"
    repo: str = "."
    cell_timeout: int | None = None
    venvs_dir: str | None = None
    notebook_parameters: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.environments:
            raise ValueError("a batch needs at least one environment")
        if not self.notebooks:
            raise ValueError("a batch needs at least one notebook")
        if not self.parameters:
            self.parameters = [{}]
        _unique("environment", [e.name for e in self.environments])
        _unique("tree", [t.display for t in self.trees])
        if unknown := sorted(set(self.notebook_parameters) - set(self.notebooks)):
            raise ValueError(
                f"notebook_parameters for notebooks not in the batch: {', '.join(unknown)}"
            )
        for nb, sets in list(self.notebook_parameters.items()):
            sets = [sets] if isinstance(sets, dict) else list(sets or [{}])
            self._check_sets(sets, f"{nb}: parameters")
            self.notebook_parameters[nb] = sets
        self._check_sets(self.parameters, "parameters")

    def _check_sets(self, sets: list[Any], what: str) -> None:
        for i, params in enumerate(sets):
            if not isinstance(params, dict):
                raise ValueError(f"{what}[{i}] must be a mapping, got {type(params).__name__}")
            if "run_dir" in params:
                raise ValueError(f"{what}[{i}]: 'run_dir' is set by the runner")
            if self.trees and "tree" in params:
                raise ValueError(f"{what}[{i}]: 'tree' is set by the batch from its trees")

    def parameters_of(self, notebook: str) -> list[dict[str, Any]]:
        """The parameter sets ``notebook`` runs with: its own, else the batch's."""
        return self.notebook_parameters.get(notebook, self.parameters)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchSpec:
        if not isinstance(data, dict):
            raise ValueError(f"a batch spec is a mapping, got {type(data).__name__}")
        known = {
            "name",
            "environments",
            "trees",
            "notebooks",
            "parameters",
            "repo",
            "cell_timeout",
            "venvs_dir",
            "notebook_parameters",
        }
        if unknown := sorted(set(data) - known):
            raise ValueError(
                f"unknown batch spec keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        envs = [_env_from(e, i) for i, e in enumerate(_list(data, "environments"))]
        trees = [_tree_from(t, i) for i, t in enumerate(_list(data, "trees"))]
        notebooks, own = [], dict(data.get("notebook_parameters") or {})
        for i, item in enumerate(_list(data, "notebooks")):
            if isinstance(item, dict):  # {"path": ..., "parameters": [...]}
                if set(item) - {"path", "parameters"} or "path" not in item:
                    raise ValueError(
                        f"notebooks[{i}]: a mapping takes path and parameters, got {sorted(item)}"
                    )
                own[str(item["path"])] = item.get("parameters", [{}])
                item = item["path"]
            notebooks.append(str(item))
        params = data.get("parameters", [{}])
        if isinstance(params, dict):
            params = [params]
        return cls(
            environments=envs,
            notebooks=notebooks,
            trees=trees,
            parameters=list(params),
            name=str(data.get("name", "batch")),
            repo=str(data.get("repo", ".")),
            cell_timeout=data.get("cell_timeout"),
            venvs_dir=data.get("venvs_dir"),
            notebook_parameters=own,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _unique(kind: str, names: list[str]) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{kind} names must be unique; repeated: {', '.join(dupes)}")


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{key!r} must be a list, got {type(value).__name__}")
    return value


def _env_from(item: Any, i: int) -> Environment:
    if not isinstance(item, dict):
        raise ValueError(
            f"environments[{i}] must be a mapping with name and python or requirements"
        )
    try:
        return Environment(**item)
    except TypeError as exc:
        raise ValueError(f"environments[{i}]: {exc}") from None


def _tree_from(item: Any, i: int) -> TreeSpec:
    if isinstance(item, str):
        return TreeSpec.parse(item)
    if not isinstance(item, dict):
        raise ValueError(f"trees[{i}] must be a string or a mapping with label and path or rev")
    try:
        return TreeSpec(**item)
    except TypeError as exc:
        raise ValueError(f"trees[{i}]: {exc}") from None


def load_spec(path: str | Path) -> BatchSpec:
    """A ``BatchSpec`` from a JSON or YAML file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"batch spec not found: {path}")
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return BatchSpec.from_dict(data)


# --- the run -----------------------------------------------------------------


@dataclass
class BatchResult:
    """The batch folder, its index, and one record per cell of the matrix."""

    folder: Path
    index: Path
    cells: list[dict[str, Any]]
    environments: list[dict[str, Any]]
    trees: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return all(c["status"] == "passed" for c in self.cells)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.cells:
            out[c["status"]] = out.get(c["status"], 0) + 1
        return out

    def table(self) -> str:
        """Plain-text table of the cells."""
        return tables.text(index_rows(self.cells), INDEX_COLUMNS)


def _check_notebooks(spec: BatchSpec) -> list[tuple[Path, list[dict[str, Any]]]]:
    """The notebooks as paths with their parameter sets, each set checked against its notebook's
    declared parameters (names and types) before anything runs."""
    out = []
    for nb in spec.notebooks:
        path = Path(nb)
        if not path.is_file():
            raise FileNotFoundError(f"notebook not found: {nb}")
        sets = spec.parameters_of(nb)
        for params in sets:
            check_parameters(path, params)
        out.append((path, sets))
    return out


def run_batch(spec: BatchSpec, runs_dir: Path = Path("runs"), progress: bool = True) -> BatchResult:
    """Run every cell of ``spec``'s matrix into ``runs_dir/batch_<UTC>_<name>/``.

    Trees, notebooks and parameters are checked first (a bad revision, a missing notebook, or a
    parameter a notebook does not declare raises before anything runs). Environments are built and registered lazily; one that fails makes its
    cells errors. The index is rewritten after every cell, so an interrupted batch leaves one.
    """
    from tqdm import tqdm

    notebooks = _check_notebooks(spec)
    venvs_dir = Path(spec.venvs_dir) if spec.venvs_dir else default_venvs_dir()
    with tempfile.TemporaryDirectory(prefix="replaykit-batch-") as tmp:
        work = Path(tmp)
        trees = [prepare_tree(t, spec.repo, work) for t in spec.trees] or [DEFAULT_TREE]
        folder = new_folder(Path(runs_dir), "batch", spec.name)
        kernels = work / "kernels"
        started = _utc()
        doc: dict[str, Any] = {
            "kind": "batch",
            "name": spec.name,
            "started_utc": started.isoformat(timespec="seconds"),
            "spec": spec.to_dict(),
            "environments": [],
            "trees": [t.record() for t in trees],
            "cells": [],
        }
        title = f"Batch {spec.name} ({started.strftime('%Y-%m-%d %H:%M UTC')})"
        per_env = len(trees) * sum(len(sets) for _, sets in notebooks)
        bar = tqdm(
            total=len(spec.environments) * per_env,
            desc=f"batch {spec.name}",
            unit="run",
            disable=not progress,
        )
        with bar, jupyter_path(kernels / "share" / "jupyter"), torch_asked_once():
            for env in spec.environments:
                bar.set_postfix_str(f"{env.name}: {'building' if env.built else 'registering'}")
                env_rec, python, kernel = _prepare_env(env, venvs_dir, kernels)
                doc["environments"].append(env_rec)
                for tree in trees:
                    for nb, sets in notebooks:
                        for params in sets:
                            bar.set_postfix_str(f"{env.name} | {tree.label} | {nb.name}")
                            cell_base = {
                                "env": env.name,
                                "python": python,
                                "kernel": kernel,
                                "tree": tree.record(),
                                "notebook": str(nb),
                                "parameters": dict(params),
                            }
                            if kernel is None:
                                cell = error_cell(cell_base, ENV_FAILED, env_rec["error"])
                            else:
                                cell = run_cell(
                                    nb,
                                    params,
                                    tree,
                                    folder=folder,
                                    kernel=kernel,
                                    python=python,
                                    env=env.name,
                                    cell_timeout=spec.cell_timeout,
                                )
                            doc["cells"].append(cell)
                            write_index(folder, doc, title)
                            bar.update()
        doc["ended_utc"] = _utc().isoformat(timespec="seconds")
        index = write_index(folder, doc, title)
    return BatchResult(
        folder=folder,
        index=index,
        cells=doc["cells"],
        environments=doc["environments"],
        trees=doc["trees"],
    )


def _prepare_env(
    env: Environment, venvs_dir: Path, kernels: Path
) -> tuple[dict[str, Any], str | None, str | None]:
    """(record, interpreter, kernel name); interpreter and kernel are None when it failed."""
    record: dict[str, Any] = {
        "name": env.name,
        "built": env.built,
        "python": None,
        "version": None,
        "kernel": None,
        "error": None,
    }
    t0 = time.monotonic()
    try:
        python = build_venv(env, venvs_dir) if env.built else str(env.python)
        info = probe(python)
        python = info.executable
        kernel = register_kernel(python, kernel_name(env.name, python), kernels)
    except (WorkflowError, OSError, subprocess.SubprocessError, ValueError) as exc:
        record["error"] = str(exc)
        return record, None, None
    finally:
        record["setup_s"] = round(time.monotonic() - t0, 3)
    record |= {"python": python, "version": info.version, "prefix": info.prefix, "kernel": kernel}
    return record, python, kernel
