"""Which Python an interpreter path runs, asked of that interpreter; and when two paths are one.

A batch builds and registers kernels for interpreters other than this one, and a wheelhouse is
resolved by a Python of another version: both must ask the interpreter itself (a path may be a
symlink, a shim or a venv whose ``sys.prefix`` differs from its base). Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

from replaykit.workflow.errors import WorkflowError

__all__ = ["Interpreter", "InterpreterError", "probe", "same_interpreter"]

_ASK = (
    "import json, platform, sys; print(json.dumps({'executable': sys.executable, "
    "'version': platform.python_version(), 'prefix': sys.prefix, 'platform': sys.platform, "
    "'machine': platform.machine()}))"
)


class InterpreterError(WorkflowError, RuntimeError):
    """An interpreter that is not there or does not run."""


@dataclass(frozen=True)
class Interpreter:
    """What an interpreter says about itself."""

    executable: str  # its sys.executable
    version: str  # platform.python_version(), e.g. 3.12.4
    prefix: str  # its sys.prefix (a venv's own folder)
    platform: str  # sys.platform, e.g. linux
    machine: str  # platform.machine(), e.g. x86_64

    @property
    def minor(self) -> str:
        """``X.Y`` of the version (what wheel tags and ``python -m pip --python-version`` use)."""
        return ".".join(self.version.split(".")[:2])


def probe(python: str, timeout: float = 60) -> Interpreter:
    """Run ``python`` (a path, or a name on PATH) and ask it; InterpreterError when it cannot run."""
    exe = shutil.which(python) if os.sep not in python else python
    if not exe or not os.path.exists(exe):
        raise InterpreterError(f"interpreter not found: {python}")
    try:
        proc = subprocess.run([exe, "-c", _ASK], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise InterpreterError(f"{python} does not run: {exc}") from exc
    if proc.returncode != 0:
        raise InterpreterError(f"{python} does not run: {proc.stderr.strip()[-500:]}")
    try:
        return Interpreter(**json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError) as exc:
        raise InterpreterError(f"{python} answered {proc.stdout.strip()[-200:]!r}: {exc}") from exc


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
