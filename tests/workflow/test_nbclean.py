"""nbclean.py: notebooks saved from Jupyter here lose their outputs; make nbcheck catches the rest."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from replaykit.workflow.nbclean import dirty, main, pre_save_hook

ROOT = Path(__file__).resolve().parents[2]
CELL = {
    "cell_type": "code",
    "id": "c1",
    "execution_count": 3,
    "metadata": {},
    "source": "1",
    "outputs": [
        {
            "output_type": "execute_result",
            "data": {"text/plain": "1"},
            "metadata": {},
            "execution_count": 3,
        }
    ],
}


def notebook(path: Path) -> Path:
    path.write_text(
        json.dumps({"cells": [CELL], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    )
    return path


def test_the_save_hook_strips_outputs() -> None:
    model = {"type": "notebook", "content": {"cells": [json.loads(json.dumps(CELL))]}}
    pre_save_hook(model, path="x.ipynb", contents_manager=None)
    assert (
        model["content"]["cells"][0]["outputs"] == []
        and model["content"]["cells"][0]["execution_count"] is None
    )
    text = {"type": "file", "content": "keep"}
    pre_save_hook(text)
    assert text["content"] == "keep"


def test_jupyter_server_config_installs_the_hook() -> None:
    config = SimpleNamespace(FileContentsManager=SimpleNamespace())
    runpy.run_path(
        str(ROOT / "jupyter_server_config.py"), init_globals={"get_config": lambda: config}
    )
    assert config.FileContentsManager.pre_save_hook is pre_save_hook


def test_check_and_strip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("nbformat")
    nb = notebook(tmp_path / "a.ipynb")
    assert dirty(nb) and main(["--check", str(nb)]) == 1
    assert "carries outputs" in capsys.readouterr().err
    assert main([str(nb)]) == 0 and not dirty(nb) and main(["--check", str(nb)]) == 0


def test_gitignore_keeps_checkpoints_and_uncommitted_runs_out() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert (
        ".ipynb_checkpoints/" in ignored and "/runs/*" in ignored and "!/runs/README.md" in ignored
    )
