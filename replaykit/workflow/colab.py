"""Run the notebooks as Colab runs them, then judge the notebooks a user would download.

    python -m replaykit.workflow.colab dist/replaykit-<commit>.tar.gz --out runs/colab_<UTC>

Each notebook is executed the way Colab's "Run all" executes it: by nbclient (not papermill),
in a kernel whose working directory holds nothing of the repository, with its parameters cell
edited as a user edits it (``tree`` set to the archive), a stand-in ``google.colab``
(``files.upload``, ``files.download``, ``drive.mount``) and ``COLAB_RELEASE_TAG`` set, so the
bootstrap takes its Colab path: it installs what the notebook lacks and never touches torch.
Execution stops at the first failing cell, as Run all does; the notebook is saved as File >
Download saves it, into ``--out``, with the run folders its last cell offers. Then ``evidence``
reads the saved notebooks by their own seals.

The CPU test of this path is tests/workflow/test_colab.py (a fresh venv holding only what Colab
preinstalls); on a GPU host the same command runs the notebooks with their GPU defaults.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["NOTEBOOKS", "QUICK", "ColabRun", "edit_parameters", "main", "run_as_colab", "stand_in"]

NOTEBOOKS = ("hazards", "parity", "benchmark", "verify")
QUICK: dict[str, dict[str, Any]] = {
    "parity": {
        "tasks": ["detection"],
        "models": ["transformer_lm"],
        "accumulations": [2],
        "device": "cpu",
    },
    "benchmark": {"quick": True, "steps": 6, "rounds": 1, "device": "cpu"},
    "hazards": {"hazards": ["inputs"], "backends": ["emulated"]},
    "verify": {
        "markers": "not cuda",
        "ids": ["tests/core/test_bitwise.py"],
        "isolate_failures": False,
    },
}
"""CPU-quick parameters per notebook (what the Colab simulation in ``make test`` runs)."""

UPLOAD_ENV, DOWNLOADS_ENV = "REPLAYKIT_COLAB_UPLOAD", "REPLAYKIT_COLAB_DOWNLOADS"
KERNEL_NAME = "replaykit-colab"
QUIET_KERNEL = ["--IPKernelApp.log_level=ERROR"]
"""The kernel's own log at ERROR: its TCP-without-encryption warning is not printed on every run."""

_STAND_IN = {
    "colab/__init__.py": '"""A stand-in for google.colab (replaykit.workflow.colab): files and drive."""\n',
    "colab/files.py": '''"""Stand-in ``google.colab.files``: ``upload`` hands over the file named by $REPLAYKIT_COLAB_UPLOAD
(copied into the working directory, as Colab's upload widget does); ``download`` copies into
$REPLAYKIT_COLAB_DOWNLOADS."""
import os
import shutil
from pathlib import Path


def upload():
    source = Path(os.environ["REPLAYKIT_COLAB_UPLOAD"])
    shutil.copyfile(source, Path.cwd() / source.name)
    print(f"Saving {source.name} to {Path.cwd() / source.name}")
    return {source.name: (Path.cwd() / source.name).read_bytes()}


def download(filename):
    dest = Path(os.environ["REPLAYKIT_COLAB_DOWNLOADS"])
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(filename, dest / Path(filename).name)
''',
    "colab/drive.py": '''"""Stand-in ``google.colab.drive``: ``mount`` says where Drive would be (it is a local folder here)."""
from pathlib import Path


def mount(mountpoint, force_remount=False):
    Path(mountpoint).mkdir(parents=True, exist_ok=True)
    print(f"Mounted at {mountpoint}")
''',
}


def stand_in(dest: Path) -> Path:
    """Write the stand-in ``google.colab`` package under ``dest`` (``google`` stays a namespace
    package, so another ``google.*`` distribution still imports); returns the folder for sys.path."""
    for rel, text in _STAND_IN.items():
        path = Path(dest) / "google" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Path(dest)


def edit_parameters(nb: Any, values: dict[str, Any]) -> None:
    """Edit the cell tagged ``parameters`` as a user edits it: each ``name: type = value  # help``
    line gets the new value, its comment kept. KeyError for a name the cell does not declare."""
    cell = next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    lines = cell.source.splitlines()
    todo = dict(values)
    for node in ast.parse(cell.source).body:
        if (
            not isinstance(node, ast.AnnAssign)
            or not isinstance(node.target, ast.Name)
            or node.target.id not in todo
        ):
            continue
        line = lines[node.lineno - 1]
        value = node.value
        assert value is not None and value.end_lineno == node.lineno, (
            f"{node.target.id}: one line per parameter"
        )
        lines[node.lineno - 1] = (
            line[: value.col_offset] + repr(todo.pop(node.target.id)) + line[value.end_col_offset :]
        )
    if todo:
        raise KeyError(f"the parameters cell declares no {', '.join(todo)}")
    cell.source = "\n".join(lines)


@dataclass
class ColabRun:
    """One notebook executed the Colab way: where the downloaded notebook is, and how it ended."""

    notebook: Path
    ok: bool
    error: str | None
    seconds: float


def _kernel_manager(python: str, env: dict[str, str], kernels: Path) -> Any:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = kernels / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", *QUIET_KERNEL]
    (spec / "kernel.json").write_text(
        json.dumps(
            {"argv": argv, "display_name": "Colab (simulated)", "language": "python", "env": env}
        )
    )
    return KernelManager(
        kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )


def run_as_colab(
    notebook: Path,
    params: dict[str, Any],
    downloads: Path,
    *,
    python: str = sys.executable,
    upload: Path | None = None,
    workdir: Path | None = None,
    cell_timeout: int | None = None,
    env: dict[str, str] | None = None,
) -> ColabRun:
    """Execute ``notebook`` as Colab would, with its parameters cell edited to ``params``; save it
    into ``downloads`` (beside what its last cell downloads). ``upload``: the file the stand-in
    ``files.upload`` hands over (set ``tree`` to ``"upload"``). The kernel runs ``python`` in a new
    folder under ``workdir`` (default: a temporary one) that holds nothing of the repository."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    downloads = Path(downloads).resolve()
    downloads.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=f"colab-{Path(notebook).stem}-", dir=workdir))
    content = base / "content"  # Colab's working directory
    content.mkdir()
    nb = nbformat.read(str(notebook), as_version=4)
    edit_parameters(nb, params)
    inherited = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not (Path(p) / "replaykit").is_dir()
    ]  # the kernel sees no replaykit but the tree's
    kernel_env = {
        "PYTHONPATH": os.pathsep.join([str(stand_in(base / "colab-stand-in")), *inherited]),
        "COLAB_RELEASE_TAG": "replaykit-simulated",
        DOWNLOADS_ENV: str(downloads),
        "MPLBACKEND": "Agg",
        **({UPLOAD_ENV: str(Path(upload).resolve())} if upload is not None else {}),
        **(env or {}),
    }
    km = _kernel_manager(python, kernel_env, base / "kernels")
    client = NotebookClient(
        nb, km=km, timeout=cell_timeout, resources={"metadata": {"path": str(content)}}
    )
    error, started = None, time.monotonic()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:  # Run all stops there
        error = str(exc).strip().splitlines()[-1][:500] if str(exc).strip() else type(exc).__name__
    out = downloads / Path(notebook).name
    nbformat.write(nb, str(out))
    shutil.rmtree(base, ignore_errors=True)  # the runtime's disk: what mattered was downloaded
    return ColabRun(out, error is None, error, time.monotonic() - started)


def _parameter(pair: list[str]) -> tuple[str, str, Any]:
    target, _, key = pair[0].rpartition(":")
    try:
        parsed = ast.literal_eval(pair[1])
    except (ValueError, SyntaxError):
        parsed = pair[1]
    return target, key, parsed


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m replaykit.workflow.colab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "archive",
        type=Path,
        help="an archive made by `replaykit-workflow pack` (a wheelhouse one offline)",
    )
    ap.add_argument(
        "--out", type=Path, required=True, help="where the downloaded notebooks and run folders go"
    )
    ap.add_argument("--notebook", action="append", choices=NOTEBOOKS, help="default: all four")
    ap.add_argument(
        "--upload",
        default="hazards",
        help="the notebook that gets its archive through files.upload",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CPU-quick parameters (QUICK); default: each notebook's own",
    )
    ap.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("[NOTEBOOK:]NAME", "VALUE"),
        help="a parameter (a Python literal), for every notebook or one: -p verify:markers 'not cuda'",
    )
    ap.add_argument(
        "--python", default=sys.executable, help="the kernel's interpreter (default: this one)"
    )
    ap.add_argument(
        "--notebooks-dir",
        type=Path,
        help="where the .ipynb files are (default: this tree's notebooks/)",
    )
    ap.add_argument("--cell-timeout", type=int, help="seconds before a cell is stopped")
    return ap


DRIVER = ["nbclient>=0.7", "nbformat>=5", "ipykernel>=6", "jupyter_client>=7"]
"""What runs the notebooks (Colab has it); a host without it gets it from the archive's wheelhouse."""


def ensure_driver(archive: Path, python: str) -> None:
    """Install nbclient and a kernel into this interpreter (and ``python``, the kernel's) when they
    are missing, from the archive's wheelhouse when it carries one (an offline GPU host)."""
    from . import bootstrap

    missing = [r for r in DRIVER if bootstrap.installed(r.split(">")[0]) is None]
    kernel_ok = (
        subprocess.run([python, "-c", "import ipykernel"], capture_output=True).returncode == 0
    )
    if not missing and kernel_ok:
        return
    with tempfile.TemporaryDirectory(prefix="replaykit-driver-") as tmp:
        root = bootstrap.unpack(archive, Path(tmp))
        bootstrap.ensure(missing, root)
        if not kernel_ok and os.path.realpath(python) != os.path.realpath(sys.executable):
            raise RuntimeError(
                f"{python} has no ipykernel: install it there (the kernel's interpreter)"
            )


def main(argv: list[str] | None = None) -> int:
    """Run the notebooks, print each one's end and the evidence; exit 0 only when every notebook
    passed and no seal was edited."""
    args = build_parser().parse_args(argv)
    archive = args.archive.resolve()
    if not archive.is_file():
        print(f"error: no archive {archive}", file=sys.stderr)
        return 2
    ensure_driver(archive, args.python)
    from .evidence import collect
    from .fingerprint import notebook_path

    overrides = [_parameter(pair) for pair in args.parameter]
    runs = []
    for name in args.notebook or NOTEBOOKS:
        path = (
            (args.notebooks_dir / f"{name}.ipynb")
            if args.notebooks_dir
            else notebook_path(f"{name}.ipynb")
        )
        params = {
            **(QUICK[name] if args.quick else {}),
            "tree": "upload" if name == args.upload else str(archive),
        }
        params |= {key: value for target, key, value in overrides if target in ("", name)}
        print(
            f"{name}: running as Colab does ({', '.join(f'{k}={v!r}' for k, v in params.items())})",
            flush=True,
        )
        run = run_as_colab(
            path,
            params,
            args.out,
            python=args.python,
            upload=archive if name == args.upload else None,
            cell_timeout=args.cell_timeout,
        )
        runs.append(run)
        print(
            f"{name}: {'passed' if run.ok else 'stopped: ' + str(run.error)} in {run.seconds:.0f} s -> {run.notebook}",
            flush=True,
        )
    ev = collect(folders=[r.notebook for r in runs])
    text = ev.markdown(relative_to=args.out)
    (args.out / "evidence.md").write_text(text)
    print(text, end="")
    return 0 if all(r.ok for r in runs) and not ev.edited else 1


if __name__ == "__main__":
    sys.exit(main())
