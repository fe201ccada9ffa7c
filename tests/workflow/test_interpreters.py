"""interpreters.py: an interpreter asked what it is; a missing or broken one is an InterpreterError."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from replaykit.workflow.errors import WorkflowError
from replaykit.workflow.interpreters import InterpreterError, probe, same_interpreter


def test_probe_asks_the_interpreter(tmp_path: Path) -> None:
    here = probe(sys.executable)
    assert same_interpreter(here.executable, sys.executable) and here.prefix == sys.prefix
    assert (
        here.version == platform.python_version()
        and here.minor == f"{sys.version_info[0]}.{sys.version_info[1]}"
    )
    assert (here.platform, here.machine) == (sys.platform, platform.machine())
    with pytest.raises(InterpreterError, match="interpreter not found") as missing:
        probe(str(tmp_path / "python"))
    assert isinstance(missing.value, WorkflowError)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho nope >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(InterpreterError, match="does not run: nope"):
        probe(str(broken))


def test_same_interpreter_does_not_resolve_a_venvs_link(tmp_path: Path) -> None:
    """A venv's ``bin/python`` links to its base's: the same file, another environment."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    os.symlink(sys.executable, venv_bin / "python")
    os.symlink(venv_bin / "python", venv_bin / "python3")
    assert not same_interpreter(str(venv_bin / "python"), sys.executable)
    assert same_interpreter(str(venv_bin / "python"), str(venv_bin / "python3"))
    assert not same_interpreter(None, sys.executable)
