"""The notebooks: committed without outputs, parameterized for papermill, and runnable through the runner on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Small parameters per notebook: the injection path is what this tests.
SMALL = {
    "parity.ipynb": {"tasks": ["detection"], "accumulations": [2], "with_unsafe": True},
    "benchmark.ipynb": {"quick": True, "steps": 8, "rounds": 2},
    "verify.ipynb": {"markers": "cuda", "ids": ["tests/test_bitwise.py"]},
}


def test_the_three_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"parity.ipynb", "verify.ipynb", "benchmark.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name} carries outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_are_typed_and_documented(path: Path) -> None:
    papermill = pytest.importorskip("papermill")
    params = papermill.inspect_notebook(str(path))
    assert "run_dir" in params and "tree" in params
    for name, info in params.items():
        assert info["inferred_type_name"] not in ("None", ""), f"{path.name}: {name} has no type"
        assert info["help"], f"{path.name}: {name} has no comment"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_through_papermill_with_injected_parameters(path: Path, tmp_path: Path) -> None:
    pytest.importorskip("papermill")
    from replaykit.runs import run_notebook

    params = SMALL.get(path.name, {})
    result = run_notebook(path, params, runs_dir=tmp_path, cwd=ROOT, progress=False)
    assert result.ok, result.summary.get("failed_cell")
    assert result.summary["parameters"].items() >= params.items()
    assert (result.run_dir / path.name).exists()
    assert result.summary["fingerprint_source"] == "notebook"  # the notebook's own fingerprint cell ran
    assert result.summary.get("results"), "the notebook wrote no results.json"
