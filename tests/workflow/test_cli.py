"""The commands: one dispatcher (`replaykit-workflow`, `python -m replaykit.workflow`), scripts/ as shims, the wheel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replaykit.workflow import cli
from replaykit.workflow.fingerprint import notebook_path

ROOT = Path(__file__).resolve().parents[2]
SHIMS = {"pack.py": "pack", "run_notebook.py": "run", "batch.py": "batch", "verify_tree.py": "verify",
         "evidence.py": "evidence", "bisect_commits.py": "bisect"}


def test_the_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(cli.COMMANDS) == set(SHIMS.values())
    assert cli.main(["--help"]) == 0 and "bisect" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["nope"]) == 2 and "unknown command" in capsys.readouterr().err
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: replaykit-workflow {name} ")


@pytest.mark.parametrize("script", sorted(SHIMS))
def test_scripts_are_shims(script: str) -> None:
    text = (ROOT / "scripts" / script).read_text()
    code = [line for line in text.splitlines() if line.strip() and not line.startswith(("#", '"""'))]
    assert len(code) <= 10, f"{script} is more than a shim"
    assert f'"{SHIMS[script]}"' in text or "archive.main(" in text


def test_a_shim_runs_the_command() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_tree.py"), "--help"],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    assert out.returncode == 0 and "usage: replaykit-workflow verify" in out.stdout


def test_a_bare_notebook_name_is_the_workflows_own() -> None:
    assert cli.notebook_arg("verify") == cli.notebook_arg("verify.ipynb") == str(ROOT / "notebooks" / "verify.ipynb")
    assert notebook_path("parity.ipynb") == ROOT / "notebooks" / "parity.ipynb"
    assert cli.notebook_arg("nb/x.ipynb") == "nb/x.ipynb"
    with pytest.raises(FileNotFoundError):
        notebook_path("nope.ipynb")
