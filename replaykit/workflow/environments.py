"""The environments a batch runs notebooks in: an existing interpreter, or a venv built for it.

    env = Environment(name="t212", requirements=["torch==2.12.0"])
    python = build_venv(env, venvs_dir)   # reused while its definition is unchanged

A built venv's folder is named after the environment and a hash of its definition (base
interpreter, requirements, options); a stamp written after a successful install marks it
reusable, so a batch interrupted mid-install builds it again instead of trusting half a venv.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from replaykit.workflow.errors import WorkflowError
from replaykit.workflow.folders import slug
from replaykit.workflow.interpreters import InterpreterError, probe

__all__ = ["ENV_STAMP", "EnvBuildError", "Environment", "build_venv", "default_venvs_dir"]

ENV_STAMP = ".replaykit-env.json"
"""Written into a venv after its install succeeded: what it was built from, its interpreter."""


class EnvBuildError(WorkflowError, RuntimeError):
    """An environment could not be built or registered as a kernel."""


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
            raise ValueError(
                f"environment {self.name!r}: give exactly one of python or requirements"
            )
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


def default_venvs_dir() -> Path:
    """``$XDG_CACHE_HOME/replaykit/venvs`` (``~/.cache/...``): built venvs outlive a batch."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "replaykit" / "venvs"


def _site_packages(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    proc = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
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
    written after a successful install marks it reusable. Raises EnvBuildError.
    """
    try:
        base = probe(env.base_python or sys.executable).executable
    except InterpreterError as exc:
        raise EnvBuildError(str(exc)) from exc
    key = {
        "base": base,
        "requirements": list(env.requirements or ()),
        "system_site_packages": env.system_site_packages,
        "site_dirs": list(env.site_dirs),
        "pip_args": list(env.pip_args),
    }
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    dest = Path(venvs_dir).resolve() / f"{slug(env.name)}-{digest}"
    stamp = dest / ENV_STAMP
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if recorded.get("key") == key and os.path.exists(recorded.get("python", "")):
            return recorded["python"]
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / f"{dest.name}.log"
    log.write_text("")
    venv_cmd = [
        base,
        "-m",
        "venv",
        *(["--system-site-packages"] if env.system_site_packages else []),
        str(dest),
    ]
    _run_logged(venv_cmd, log, f"python -m venv for {env.name!r}", timeout)
    python = next(
        (str(p) for p in (dest / "bin" / "python", dest / "Scripts" / "python.exe") if p.exists()),
        None,
    )
    if python is None:
        raise EnvBuildError(f"venv {dest} has no interpreter")
    if env.site_dirs:
        lines = [f"import site; site.addsitedir({os.path.abspath(d)!r})" for d in env.site_dirs]
        (Path(_site_packages(python)) / "_replaykit_site_dirs.pth").write_text(
            "\n".join(lines) + "\n"
        )
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        *env.pip_args,
        *(env.requirements or ()),
        "ipykernel",
    ]
    _run_logged(pip, log, f"pip install for {env.name!r}", timeout)
    built = _dt.datetime.now(_dt.timezone.utc).isoformat()
    stamp.write_text(json.dumps({"key": key, "python": python, "built_utc": built}, indent=1))
    return python
