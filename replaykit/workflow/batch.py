# One module: a cell's environment, kernel, tree and index record are built and checked against each other here.
"""Run a matrix of environments × trees × notebooks × parameter sets; one index per batch.

    spec = load_spec("batch.json")            # or BatchSpec(...)
    result = run_batch(spec, Path("runs"))    # runs/batch_<UTC>_<name>/index.json + index.md

An ``Environment`` is an existing interpreter (``python``) or a requirement set to build a
virtual environment for (``requirements``). Each gets its own kernelspec, registered in a
folder private to the batch and put first on ``JUPYTER_PATH`` while it runs, so no installed
``python3`` spec can stand in for it; after every run the kernelspec's interpreter and the
notebook's fingerprint must name that environment's interpreter, else the cell is an error
("wrong interpreter"). A tree is a folder, a packed archive, or a git revision (packed with
``replaykit.pack`` and unpacked, so the notebook sees exactly that commit). A cell that
fails, dies or cannot start is recorded and the batch goes on.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from replaykit import tables
from replaykit.workflow import archive as pk
from replaykit.workflow.evidence import tree_text
from replaykit.workflow.fingerprint import tree_info
from replaykit.workflow.folders import INDEX_FILE, unique_folder
from replaykit.workflow.folders import slug as _slug
from replaykit.workflow.runs import (
    check_parameters,
    ensure_kernel,
    kernel_executable,
    run_notebook,
    summary_line,
)

__all__ = [
    "BatchResult", "BatchSpec", "EnvBuildError", "Environment", "PreparedTree", "TreeSpec",
    "build_venv", "declares", "error_cell", "index_rows", "interpreter_problem", "kernel_name",
    "load_spec", "new_folder", "prepare_tree", "register_kernel", "run_batch", "run_cell",
    "same_interpreter", "write_index",
]

INDEX_MD = "index.md"
INDEX_SCHEMA = 1
ENV_STAMP = ".replaykit-env.json"
WRONG_INTERPRETER = "wrong interpreter"
ENV_FAILED = "env build failed"
INDEX_COLUMNS = ("env", "tree", "notebook", "parameters", "status", "summary", "run_dir")


class EnvBuildError(RuntimeError):
    """An environment could not be built or registered as a kernel."""


def _utc() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


# --- the spec ----------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    """An interpreter to run notebooks with: an existing one, or a venv built from requirements.

    ``python``: path (or name on PATH) of an interpreter that has ipykernel. ``requirements``
    (a list, possibly empty): build a venv with ``base_python -m venv`` (default: this
    interpreter; a venv made from a venv gets the base installation's site-packages with
    ``system_site_packages``), then ``pip install *pip_args *requirements ipykernel``.
    ``site_dirs`` are added after the venv's own site-packages (``site.addsitedir`` in a
    ``.pth``), e.g. an existing environment whose packages the new venv should reuse.
    """

    name: str
    python: str | None = None
    requirements: tuple[str, ...] | None = None
    base_python: str | None = None
    system_site_packages: bool = False
    site_dirs: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError("an environment needs a non-empty name")
        if (self.python is None) == (self.requirements is None):
            raise ValueError(f"environment {self.name!r}: give exactly one of python or requirements")
        for key in ("requirements", "site_dirs", "pip_args"):
            value = getattr(self, key)
            if isinstance(value, str):
                raise ValueError(f"environment {self.name!r}: {key} must be a list, not a string")
            if value is not None:
                object.__setattr__(self, key, tuple(str(v) for v in value))
        if self.python is not None and (
            self.base_python or self.system_site_packages or self.site_dirs or self.pip_args
        ):
            raise ValueError(
                f"environment {self.name!r}: base_python, system_site_packages, site_dirs and "
                "pip_args apply to a built venv (requirements), not to an existing python"
            )

    @property
    def built(self) -> bool:
        return self.requirements is not None


@dataclass(frozen=True)
class TreeSpec:
    """A tree to run against: ``path`` (a folder or a packed archive) or ``rev`` (a git revision)."""

    label: str | None = None
    path: str | None = None
    rev: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.rev is None):
            raise ValueError(f"tree {self.label or '(no label)'}: give exactly one of path or rev")

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """``[LABEL=]PATH_OR_REV``: an existing path is a path, anything else a revision."""
        label, sep, value = text.partition("=")
        if not sep or not label or "/" in label:
            label, value = "", text
        if not value:
            raise ValueError(f"empty tree in {text!r}")
        if Path(value).expanduser().exists():
            return cls(label=label or None, path=value)
        return cls(label=label or None, rev=value)

    @property
    def display(self) -> str:
        if self.label:
            return self.label
        return self.rev if self.rev is not None else Path(str(self.path)).resolve().name


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
            raise ValueError(f"notebook_parameters for notebooks not in the batch: {', '.join(unknown)}")
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
        known = {"name", "environments", "trees", "notebooks", "parameters", "repo",
                 "cell_timeout", "venvs_dir", "notebook_parameters"}
        if unknown := sorted(set(data) - known):
            raise ValueError(f"unknown batch spec keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        envs = [_env_from(e, i) for i, e in enumerate(_list(data, "environments"))]
        trees = [_tree_from(t, i) for i, t in enumerate(_list(data, "trees"))]
        notebooks, own = [], dict(data.get("notebook_parameters") or {})
        for i, item in enumerate(_list(data, "notebooks")):
            if isinstance(item, dict):  # {"path": ..., "parameters": [...]}
                if set(item) - {"path", "parameters"} or "path" not in item:
                    raise ValueError(f"notebooks[{i}]: a mapping takes path and parameters, got {sorted(item)}")
                own[str(item["path"])] = item.get("parameters", [{}])
                item = item["path"]
            notebooks.append(str(item))
        params = data.get("parameters", [{}])
        if isinstance(params, dict):
            params = [params]
        return cls(
            environments=envs, notebooks=notebooks, trees=trees, parameters=list(params),
            name=str(data.get("name", "batch")), repo=str(data.get("repo", ".")),
            cell_timeout=data.get("cell_timeout"), venvs_dir=data.get("venvs_dir"), notebook_parameters=own,
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
        raise ValueError(f"environments[{i}] must be a mapping with name and python or requirements")
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


# --- trees -------------------------------------------------------------------


@dataclass
class PreparedTree:
    """A tree ready to run: its folder and where it came from."""

    label: str
    path: Path | None  # None: the notebook's own default tree
    source: str  # "path" | "archive" | "rev" | "default"
    rev: str | None = None
    commit: str | None = None
    dirty: bool | None = None
    sha256: str | None = None  # content hash from the pack manifest

    @property
    def short(self) -> str | None:
        return self.commit[:7] if self.commit else None

    def record(self) -> dict[str, Any]:
        return {
            "label": self.label, "source": self.source, "rev": self.rev, "commit": self.commit,
            "short": self.short, "dirty": self.dirty, "sha256": self.sha256,
            "path": str(self.path) if self.source == "path" and self.path else None,
        }


DEFAULT_TREE = PreparedTree(label="default", path=None, source="default")


def _from_manifest(label: str, root: Path, source: str, rev: str | None) -> PreparedTree:
    manifest = json.loads((root / pk.MANIFEST_NAME).read_text())
    return PreparedTree(label=label, path=root, source=source, rev=rev, commit=manifest["commit"],
                        dirty=manifest["dirty"], sha256=manifest["sha256"])


def prepare_tree(spec: TreeSpec, repo: str | Path, workdir: Path) -> PreparedTree:
    """Resolve ``spec`` to a folder. A rev is packed from ``repo`` and unpacked under ``workdir``.

    Raises ValueError (not a commit, a bad archive) or FileNotFoundError (no such path).
    """
    label = spec.display

    def fresh(kind: str) -> Path:
        (Path(workdir) / kind).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{_slug(label)}-", dir=Path(workdir) / kind))

    if spec.rev is not None:
        packed = pk.pack(Path(repo), fresh("archives"), rev=spec.rev)
        return _from_manifest(label, pk.unpack(packed.path, fresh("trees")), "rev", spec.rev)
    path = Path(str(spec.path)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tree {label!r}: {path} does not exist")
    if path.is_file():
        if not path.name.endswith((".tar.gz", ".tgz")):
            raise ValueError(f"tree {label!r}: {path} is neither a folder nor a packed .tar.gz")
        return _from_manifest(label, pk.unpack(path, fresh("trees")), "archive", None)
    info = tree_info(path)
    return PreparedTree(label=label, path=path.resolve(), source="path",
                        commit=info.get("commit"), dirty=info.get("dirty"))


# --- interpreters and kernels ------------------------------------------------


def same_interpreter(a: str | None, b: str | None) -> bool:
    """True when ``a`` and ``b`` are one interpreter of one environment.

    Paths are not resolved through symlinks (a venv's ``python`` links to its base's);
    ``bin/python`` and ``bin/python3`` of one folder count as the same.
    """
    if not a or not b:
        return False
    a, b = os.path.abspath(a), os.path.abspath(b)
    if a == b:
        return True
    try:
        return os.path.dirname(a) == os.path.dirname(b) and os.path.samefile(a, b)
    except OSError:
        return False


def _probe(python: str) -> dict[str, str]:
    """``sys.executable``, version and prefix of interpreter ``python``; raises when it cannot run."""
    exe = shutil.which(python) if os.sep not in python else python
    if not exe or not os.path.exists(exe):
        raise EnvBuildError(f"interpreter not found: {python}")
    code = "import json, platform, sys; print(json.dumps({'executable': sys.executable, " \
           "'version': platform.python_version(), 'prefix': sys.prefix}))"
    try:
        proc = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EnvBuildError(f"{python} does not run: {exc}") from exc
    if proc.returncode != 0:
        raise EnvBuildError(f"{python} does not run: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernel_name(env_name: str, python: str) -> str:
    """``replaykit-batch-<env>-<hash of the interpreter path>``: unique per environment."""
    digest = hashlib.sha1(os.path.abspath(python).encode()).hexdigest()[:8]
    return f"replaykit-batch-{_slug(env_name)}-{digest}"


@contextlib.contextmanager
def _jupyter_path(folder: Path) -> Iterator[None]:
    """Put ``folder`` first on ``JUPYTER_PATH`` (kernelspecs there win over installed ones)."""
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(folder), old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old


def register_kernel(python: str, name: str, prefix: Path) -> str:
    """``python -m ipykernel install --prefix prefix --name name``; check it launches ``python``.

    The spec lands in ``prefix/share/jupyter/kernels/name``; callers put ``prefix/share/jupyter``
    on ``JUPYTER_PATH`` to use it. Raises EnvBuildError when ipykernel is missing or the
    name resolves to another interpreter.
    """
    cmd = [python, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", name,
           "--display-name", f"{name} ({python})"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-800:]
        raise EnvBuildError(f"cannot register a kernel for {python} (is ipykernel installed?): {tail}")
    with _jupyter_path(prefix / "share" / "jupyter"):
        found = kernel_executable(name)
    if not same_interpreter(found, python):
        raise EnvBuildError(f"kernelspec {name!r} launches {found}, not {python}")
    return name


def _site_packages(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip()


def _run_logged(cmd: list[str], log: Path, what: str, timeout: float) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise EnvBuildError(f"{what} timed out after {timeout:.0f} s (log: {log})") from exc
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip()[-1500:]
        raise EnvBuildError(f"{what} failed (exit {proc.returncode}); log {log}:\n{tail}")


def build_venv(env: Environment, venvs_dir: Path, timeout: float = 3600) -> str:
    """Build (or reuse) the venv of ``env`` under ``venvs_dir``; return its interpreter.

    The folder is named after the environment and a hash of its definition; a stamp file
    written after a successful install marks it reusable.
    """
    base = _probe(env.base_python or sys.executable)["executable"]
    key = {"base": base, "requirements": list(env.requirements or ()),
           "system_site_packages": env.system_site_packages, "site_dirs": list(env.site_dirs),
           "pip_args": list(env.pip_args)}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    dest = Path(venvs_dir).resolve() / f"{_slug(env.name)}-{digest}"
    stamp = dest / ENV_STAMP
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if recorded.get("key") == key and os.path.exists(recorded.get("python", "")):
            return recorded["python"]
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / f"{dest.name}.log"
    log.write_text("")
    venv_cmd = [base, "-m", "venv", *(["--system-site-packages"] if env.system_site_packages else []), str(dest)]
    _run_logged(venv_cmd, log, f"python -m venv for {env.name!r}", timeout)
    python = next((str(p) for p in (dest / "bin" / "python", dest / "Scripts" / "python.exe") if p.exists()), None)
    if python is None:
        raise EnvBuildError(f"venv {dest} has no interpreter")
    if env.site_dirs:
        lines = [f"import site; site.addsitedir({os.path.abspath(d)!r})" for d in env.site_dirs]
        (Path(_site_packages(python)) / "_replaykit_site_dirs.pth").write_text("\n".join(lines) + "\n")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", *env.pip_args,
           *(env.requirements or ()), "ipykernel"]
    _run_logged(pip, log, f"pip install for {env.name!r}", timeout)
    stamp.write_text(json.dumps({"key": key, "python": python, "built_utc": _utc().isoformat()}, indent=1))
    return python


# --- one cell ----------------------------------------------------------------


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
    return base | {"status": "error", "reason": reason, "summary": f"error: {reason}: {first}".rstrip(": "),
                   "detail": detail[-3000:], "run_dir": None, "sha256": None, "counts": None,
                   "duration_s": 0.0}


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
    base = {"env": env, "python": python, "kernel": kernel, "tree": tree.record(),
            "notebook": str(notebook), "parameters": dict(parameters)}
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
        result = run_notebook(notebook, params, runs_dir=folder, kernel_name=kernel,
                              cell_timeout=cell_timeout, progress=False, tree=tree.path, cwd=cwd)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        return error_cell(base, "exception", f"{type(exc).__name__}: {exc}")
    s = result.summary
    record = base | {
        "status": s["status"], "reason": s.get("reason"), "summary": summary_line(s),
        "run_dir": os.path.relpath(result.run_dir, folder), "sha256": s.get("sha256"),
        "counts": s.get("counts"), "duration_s": s.get("duration_s"),
    }
    problem = interpreter_problem(s, python) if python else None
    if problem:
        record |= {"status": "error", "reason": WRONG_INTERPRETER,
                   "summary": f"error: {WRONG_INTERPRETER}: {problem}", "detail": problem}
    return record


# --- index -------------------------------------------------------------------


def new_folder(runs_dir: Path, kind: str, name: str) -> Path:
    """``runs_dir/<kind>_<UTC>_<name>`` (``-2``, ``-3``… when taken), created."""
    return unique_folder(runs_dir, f"{kind}_{_utc().strftime('%Y%m%dT%H%M%SZ')}_{_slug(name)}")


def _tree_text(tree: dict[str, Any]) -> str:
    return tree_text(tree, tree["label"]) if tree.get("commit") else tree["label"]


def index_rows(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for ``tables`` (one per cell): env, tree, notebook, parameters, status, summary, run_dir."""
    rows = []
    for c in cells:
        status = c["status"]
        if c.get("reason") and status != "passed":
            status += f" ({c['reason']})"
        params = json.dumps(c["parameters"], sort_keys=True) if c["parameters"] else ""
        rows.append({"env": c["env"], "tree": _tree_text(c["tree"]), "notebook": Path(c["notebook"]).name,
                     "parameters": params, "status": status, "summary": c["summary"],
                     "run_dir": c.get("run_dir") or ""})
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
    md = [f"# {title}", "", f"{len(cells)} cells: {tally}", "",
          tables.markdown(index_rows(cells), INDEX_COLUMNS), ""]
    (Path(folder) / INDEX_MD).write_text("\n".join(md))
    return path


# --- the batch ---------------------------------------------------------------


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


def _default_venvs_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "replaykit" / "venvs"


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
    venvs_dir = Path(spec.venvs_dir) if spec.venvs_dir else _default_venvs_dir()
    with tempfile.TemporaryDirectory(prefix="replaykit-batch-") as tmp:
        work = Path(tmp)
        trees = [prepare_tree(t, spec.repo, work) for t in spec.trees] or [DEFAULT_TREE]
        folder = new_folder(Path(runs_dir), "batch", spec.name)
        kernels = work / "kernels"
        started = _utc()
        doc: dict[str, Any] = {
            "kind": "batch", "name": spec.name, "started_utc": started.isoformat(timespec="seconds"),
            "spec": spec.to_dict(), "environments": [], "trees": [t.record() for t in trees], "cells": [],
        }
        title = f"Batch {spec.name} ({started.strftime('%Y-%m-%d %H:%M UTC')})"
        per_env = len(trees) * sum(len(sets) for _, sets in notebooks)
        bar = tqdm(total=len(spec.environments) * per_env, desc=f"batch {spec.name}", unit="run",
                   disable=not progress)
        with bar, _jupyter_path(kernels / "share" / "jupyter"):
            for env in spec.environments:
                bar.set_postfix_str(f"{env.name}: {'building' if env.built else 'registering'}")
                env_rec, python, kernel = _prepare_env(env, venvs_dir, kernels)
                doc["environments"].append(env_rec)
                for tree in trees:
                    for nb, sets in notebooks:
                        for params in sets:
                            bar.set_postfix_str(f"{env.name} | {tree.label} | {nb.name}")
                            cell_base = {"env": env.name, "python": python, "kernel": kernel,
                                         "tree": tree.record(), "notebook": str(nb),
                                         "parameters": dict(params)}
                            if kernel is None:
                                cell = error_cell(cell_base, ENV_FAILED, env_rec["error"])
                            else:
                                cell = run_cell(nb, params, tree, folder=folder, kernel=kernel,
                                                python=python, env=env.name,
                                                cell_timeout=spec.cell_timeout)
                            doc["cells"].append(cell)
                            write_index(folder, doc, title)
                            bar.update()
        doc["ended_utc"] = _utc().isoformat(timespec="seconds")
        index = write_index(folder, doc, title)
    return BatchResult(folder=folder, index=index, cells=doc["cells"],
                       environments=doc["environments"], trees=doc["trees"])


def _prepare_env(env: Environment, venvs_dir: Path, kernels: Path) -> tuple[dict[str, Any], str | None, str | None]:
    """(record, interpreter, kernel name); interpreter and kernel are None when it failed."""
    record: dict[str, Any] = {"name": env.name, "built": env.built, "python": None, "version": None,
                              "kernel": None, "error": None}
    t0 = time.monotonic()
    try:
        python = build_venv(env, venvs_dir) if env.built else str(env.python)
        info = _probe(python)
        python = info["executable"]
        kernel = register_kernel(python, kernel_name(env.name, python), kernels)
    except (EnvBuildError, OSError, subprocess.SubprocessError, ValueError) as exc:
        record["error"] = str(exc)
        return record, None, None
    finally:
        record["setup_s"] = round(time.monotonic() - t0, 3)
    record |= {"python": python, "version": info["version"], "prefix": info["prefix"], "kernel": kernel}
    return record, python, kernel
