"""The notebooks: committed without outputs, parameterized for papermill, and runnable through the runner on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Small parameters per notebook: the injection path is what this tests. The zoo and whole-step
# cells at these sizes are nbval's run (notebooks/conftest.py: replaykit.workflow.colab.QUICK).
SMALL = {
    "parity.ipynb": {
        "tasks": ["detection"],
        "models": [],
        "accumulations": [2],
        "with_unsafe": True,
        "whole_step": False,
    },
    "benchmark.ipynb": {"quick": True, "steps": 6, "rounds": 1, "models": []},
    "hazards.ipynb": {
        "hazards": ["inputs", "crashes"],
        "apis": ["capture", "whole_step"],  # the whole_step patterns of crashes: a resumed fit
        "unsafe": True,
    },
}


def test_the_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {
        "parity.ipynb",
        "verify.ipynb",
        "benchmark.ipynb",
        "hazards.ipynb",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
                f"{path.name} carries outputs"
            )


def _bootstrap(name: str) -> str:
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    return next(
        "".join(c["source"]) for c in cells if "".join(c["source"]).startswith("# Bootstrap")
    )


def test_the_notebooks_share_one_short_bootstrap() -> None:
    """It runs before replaykit is importable: it only fetches (an upload, Drive, a git URL and ref) and
    hands over to the tree's bootstrap.py, naming its notebook (the extras it needs).

    verify.ipynb's last line also says that its `tree` is the tree under test, not the replaykit to run.
    """
    cells = {p.stem: _bootstrap(p.name).splitlines() for p in NOTEBOOKS}
    parity = cells["parity"]
    for name, lines in cells.items():
        differ = [i for i, (a, b) in enumerate(zip(lines, parity, strict=True)) if a != b]
        assert differ == ([] if name == "parity" else [len(lines) - 1]) or (
            name == "verify" and len(differ) == 2
        ), name
        assert lines[-1].startswith(f'boot.bootstrap(tree, "{name}"'), lines[-1]
    src = next(line for line in cells["verify"] if line.startswith("src = "))
    assert src.startswith(
        'src = "" if importlib.util.find_spec("replaykit") else tree'
    )  # its tree is only tested
    assert 'on_path=importlib.util.find_spec("replaykit") is None' in cells["verify"][-1]
    code = [line for line in parity if line.strip() and not line.startswith("#")]
    assert len(code) <= 30
    assert not {"hashlib", "json", "extractall", "pip"} & set(
        " ".join(parity).replace(",", " ").split()
    )


def test_each_notebook_ends_with_its_seal() -> None:
    """The last cell seals the verdict into the notebook (a download is evidence) before it fails the run."""
    for path in NOTEBOOKS:
        last = json.loads(path.read_text())["cells"][-1]
        source = "".join(last["source"])
        assert last["cell_type"] == "code" and f'finish("{path.name}", ' in source, path.name
        assert source.index("finish(") < source.rindex(
            "raise" if path.stem == "verify" else "assert not failed"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_are_typed_and_documented(path: Path) -> None:
    papermill = pytest.importorskip("papermill")
    params = papermill.inspect_notebook(str(path))
    assert "run_dir" in params and "tree" in params
    for name, info in params.items():
        assert info["inferred_type_name"] not in ("None", ""), f"{path.name}: {name} has no type"
        assert info["help"], f"{path.name}: {name} has no comment"


# verify.ipynb's papermill runs (injected tree, markers, ids; the same checks) are
# tests/workflow/test_verify.py::test_notebook_through_the_runner; on this checkout's own tests,
# the Colab simulation (test_colab.py) runs it
@pytest.mark.parametrize(
    "path", [p for p in NOTEBOOKS if p.name != "verify.ipynb"], ids=lambda p: p.name
)
@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.slow
def test_runs_through_papermill_with_injected_parameters(path: Path, tmp_path: Path) -> None:
    pytest.importorskip("papermill")
    from replaykit.workflow.runs import run_notebook

    params = SMALL.get(path.name, {})
    result = run_notebook(path, params, runs_dir=tmp_path, cwd=ROOT, progress=False)
    assert result.ok, result.summary.get("failed_cell")
    assert result.summary["parameters"].items() >= params.items()
    assert (result.run_dir / path.name).exists()
    assert (
        result.summary["fingerprint_source"] == "notebook"
    )  # the notebook's own fingerprint cell ran
    assert result.summary.get("results"), "the notebook wrote no results.json"


def test_bootstrap_refuses_an_edited_archive(tmp_path: Path) -> None:
    pytest.importorskip("papermill")
    import io
    import tarfile

    from replaykit.workflow.archive import pack
    from replaykit.workflow.runs import run_notebook

    archive = pack(ROOT, tmp_path / "tree.tar.gz").path
    edited = tmp_path / "edited.tar.gz"
    with tarfile.open(archive) as src, tarfile.open(edited, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name.endswith("replaykit/testing/bench/network.py"):
                data = data + b"\n# edited after packing\n"
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    result = run_notebook(
        ROOT / "notebooks" / "benchmark.ipynb",
        {"tree": str(edited)},
        runs_dir=tmp_path / "runs",
        cwd=tmp_path,
        progress=False,
    )
    assert not result.ok
    assert "does not match its manifest" in json.dumps(result.summary["failed_cell"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_run_all_without_tree_says_what_to_set(path: Path, tmp_path: Path) -> None:
    """Colab's Run all with the default ``tree = ""`` and no replaykit installed: one clear line
    naming the parameter to set (it was a bare StopIteration)."""
    import subprocess
    import sys

    cell = next(
        "".join(c["source"])
        for c in json.loads(path.read_text())["cells"]
        if "".join(c["source"]).startswith("# Bootstrap")
    )
    done = subprocess.run(  # -S: no site-packages, so no installed replaykit; the cell needs none
        [sys.executable, "-S", "-c", 'tree = ""\n' + cell],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith(
        "RuntimeError: set `tree` in the parameters cell"
    ), done.stderr
