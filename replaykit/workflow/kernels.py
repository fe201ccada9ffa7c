"""Kernelspecs private to a batch: each environment's interpreter registered under a name of its own.

The specs go into a folder that ``jupyter_path`` puts first on ``JUPYTER_PATH`` while the batch
runs, so no installed ``python3`` spec (which may launch another environment) can stand in for
one; ``register_kernel`` checks that the name resolves to the interpreter it was made for.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from replaykit.workflow.environments import EnvBuildError
from replaykit.workflow.folders import slug
from replaykit.workflow.interpreters import same_interpreter
from replaykit.workflow.runs import kernel_executable

__all__ = ["jupyter_path", "kernel_name", "register_kernel"]


def kernel_name(env_name: str, python: str) -> str:
    """``replaykit-batch-<env>-<hash of the interpreter path>``: unique per environment."""
    digest = hashlib.sha1(os.path.abspath(python).encode()).hexdigest()[:8]
    return f"replaykit-batch-{slug(env_name)}-{digest}"


@contextlib.contextmanager
def jupyter_path(folder: Path) -> Iterator[None]:
    """Put ``folder`` first on ``JUPYTER_PATH`` (kernelspecs there win over installed ones); restore it after."""
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
    cmd = [
        python,
        "-m",
        "ipykernel",
        "install",
        "--prefix",
        str(prefix),
        "--name",
        name,
        "--display-name",
        f"{name} ({python})",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-800:]
        raise EnvBuildError(
            f"cannot register a kernel for {python} (is ipykernel installed?): {tail}"
        )
    with jupyter_path(prefix / "share" / "jupyter"):
        found = kernel_executable(name)
    if not same_interpreter(found, python):
        raise EnvBuildError(f"kernelspec {name!r} launches {found}, not {python}")
    return name
