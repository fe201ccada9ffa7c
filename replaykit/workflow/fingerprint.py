"""Environment fingerprint: which tree, interpreter, torch and device a run used.

Small, cheap and JSON-serialisable (no ``torch.utils.collect_env``). The first
cell of every notebook records one; ``fingerprint_slug`` names run folders.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from replaykit.workflow import archive
from replaykit.workflow.bootstrap import MANIFEST_NAME, in_colab, installed
from replaykit.workflow.errors import WorkflowError
from replaykit.workflow.folders import slug
from replaykit.workflow.git import GitError, git_text

__all__ = [
    "FINGERPRINT_FILE",
    "MANIFEST_NAME",
    "NeedsSourceTree",
    "default_tree",
    "fingerprint",
    "fingerprint_slug",
    "in_colab",
    "notebook_path",
    "record_fingerprint",
    "source_tree",
    "tree_info",
]

FINGERPRINT_FILE = "fingerprint.json"
"""File a notebook writes into its run dir; the runner prefers it to its own fingerprint."""

DIRTY_IGNORE = ("runs/",)
"""Paths whose changes do not make a checkout dirty (run evidence is written there)."""


class NeedsSourceTree(WorkflowError, ValueError):
    """replaykit runs from an installed wheel and the command needs a checkout, a folder or an archive."""


def source_tree() -> Path | None:
    """The source checkout that holds this replaykit package; None when it is installed (a wheel)."""
    root = Path(__file__).resolve().parents[2]
    return (
        root
        if (root / "pyproject.toml").is_file() and (root / "replaykit" / "__init__.py").is_file()
        else None
    )


def default_tree() -> Path:
    """The source tree that holds this replaykit package; NeedsSourceTree when it is installed."""
    root = source_tree()
    if root is None:
        raise NeedsSourceTree(
            f"needs a source tree: replaykit is installed ({Path(__file__).resolve().parents[1]}), "
            "not a checkout; give a tree (a checkout, a folder or an archive from `replaykit-workflow pack`): "
            "`-p tree PATH` to `replaykit-workflow run` (the notebook's parameter), `--tree PATH` to `verify`"
        )
    return root


def notebook_path(name: str) -> Path:
    """``notebooks/<name>`` of the source tree, else the copy a wheel ships in ``replaykit/workflow/notebooks/``."""
    root = source_tree()
    for folder in ([root / "notebooks"] if root else []) + [
        Path(__file__).resolve().parent / "notebooks"
    ]:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(
        f"no notebook {name!r} in this checkout's notebooks/ or in the installed replaykit"
    )


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 5.0) -> str | None:
    """stdout of ``cmd``, or None when it is missing, fails or times out."""
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _manifest_info(path: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"source": "manifest", "commit": None, "dirty": None, "sha256": None}
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("manifest is not a JSON object")
    except (OSError, ValueError) as exc:
        info["error"] = f"{path.name}: {exc}"
        return info
    missing = [k for k in ("commit", "dirty", "sha256") if k not in manifest]
    if missing:
        info["error"] = f"{path.name} lacks {', '.join(missing)}"
    info.update({k: manifest.get(k) for k in ("commit", "dirty", "sha256")})
    info["manifest"] = manifest
    return info


def _git_info(tree: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"source": "git", "commit": None, "dirty": None}
    try:
        info["commit"] = git_text(tree, "rev-parse", "HEAD", timeout=5).strip()
    except GitError as exc:
        info["error"] = str(exc)
        return info
    try:
        remote = git_text(tree, "config", "--get", "remote.origin.url", timeout=5).strip()
    except GitError:
        remote = ""
    if remote:  # a clone of a git URL (a notebook's tree): where the commit came from
        info["remote"] = re.sub(r"//[^/@]+@", "//", remote)  # no credentials in the evidence
    try:
        status = git_text(tree, "status", "--porcelain", timeout=5)
    except GitError:
        return info  # the commit is known, whether it is dirty is not
    changed = [line[3:] for line in status.splitlines() if not line[3:].startswith(DIRTY_IGNORE)]
    info["dirty"] = bool(changed)
    info["changed"] = changed[:20]
    return info


def tree_info(tree: str | Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of ``tree``: its git checkout if it is one, else its manifest.

    A checkout's own history wins over a manifest lying in it (which may be stale);
    an uploaded tree has no ``.git`` and is known by its manifest. ``tree`` must be
    the root of the tree; a subdirectory of some other checkout is not attributed
    to that checkout.
    """
    if tree is None and source_tree() is None:  # an installed wheel: no commit to record
        return {
            "path": str(Path(__file__).resolve().parents[1]),
            "source": "installed",
            "commit": None,
            "dirty": None,
        }
    path = Path(tree) if tree is not None else default_tree()
    path = path.resolve()
    base = {"path": str(path)}
    if (path / ".git").exists():
        return base | _git_info(path)
    if (path / MANIFEST_NAME).is_file():
        return base | _manifest_info(path / MANIFEST_NAME)
    if path.is_file() and tarfile.is_tarfile(
        path
    ):  # a packed tree: its verified manifest says what it is
        try:
            manifest = archive.verify_archive(path)
        except (OSError, ValueError) as exc:
            return base | {"source": "archive", "commit": None, "dirty": None, "error": str(exc)}
        return base | {
            "source": "archive",
            **{k: manifest.get(k) for k in ("commit", "dirty", "sha256")},
        }
    return base | {"source": None, "commit": None, "dirty": None}


def _torch_info() -> dict[str, Any]:
    info: dict[str, Any] = dict.fromkeys(("torch", "cuda", "cudnn", "gpu", "gpu_count"))
    info["device"] = "cpu"
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # a broken cuDNN install must not break the fingerprint
        info["cudnn"] = None
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu"] = info["device"] = torch.cuda.get_device_name(0)
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info["device"] = "mps"
    return info


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    out = (
        _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], timeout=3)
        if smi
        else None
    )
    lines = out.strip().splitlines() if out else []
    return lines[0].strip() if lines else None


def fingerprint(tree: str | Path | None = None) -> dict[str, Any]:
    """The environment of this process and the tree it runs (default: replaykit's own tree)."""
    return {
        "tree": tree_info(tree),
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        **_torch_info(),
        "driver": _driver(),
        "papermill": installed("papermill"),
        "nbclient": installed("nbclient"),
        "colab": in_colab(),
        "hostname": socket.gethostname(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


_TORCH_OF = """
import json
info = {"torch": None, "device": "cpu"}
try:
    import torch
except ImportError:
    pass
else:
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info["device"] = "mps"
print(json.dumps(info))
"""


def torch_of(python: str, timeout: float = 120) -> dict[str, Any] | None:
    """``{"torch": version, "device": ...}`` of another interpreter (a batch's kernel), or None when it
    does not run. What ``fingerprint_slug`` needs to name a run after the interpreter that ran it."""
    out = _run([python, "-c", _TORCH_OF], timeout=timeout)
    try:
        return json.loads(out.strip().splitlines()[-1]) if out else None
    except (ValueError, IndexError):
        return None


def record_fingerprint(
    run_dir: str | Path | None = None, tree: str | Path | None = None
) -> dict[str, Any]:
    """Compute the fingerprint and, when ``run_dir`` is given, write it to ``fingerprint.json`` there.

    Meant for a notebook's first cell: ``record_fingerprint(run_dir)``.
    """
    fp = fingerprint(tree)
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / FINGERPRINT_FILE).write_text(json.dumps(fp, indent=1) + "\n")
    return fp


def fingerprint_slug(fp: dict[str, Any]) -> str:
    """``<device>_torch<version>_<tree>`` for a run folder name, e.g. ``cpu_torch2.13.0_3f2a1b9``.

    Only letters, digits, ``.``, ``-`` inside a part; ``_`` separates the parts. The torch
    local version (``+cpu``, ``+cu128``) is dropped; the device says which build it was.
    """
    device = slug(str(fp.get("device") or "unknown"), lower=False, empty="unknown")
    torch_version = slug(str(fp.get("torch") or "none").split("+")[0], lower=False, empty="unknown")
    tree = fp.get("tree") or {}
    commit = tree.get("commit")
    if commit:
        label = slug(str(commit), lower=False, empty="unknown")[:7]
        if tree.get("dirty"):
            label += "-dirty"
    else:
        label = "notree"
    return f"{device}_torch{torch_version}_{label}"
