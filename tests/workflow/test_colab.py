"""Colab's "Run all", simulated: each notebook in a runtime holding only what Colab preinstalls.

The runtime is a venv of ``colab-runtime.txt`` (with the CPU ``torch==2.13.0`` in place of Colab's
CUDA build), built once and cached under ``~/.cache/replaykit/colab-runtime/<key>`` (the key
hashes the list). Each test session gets a thin venv on top of it (its own site-packages first,
the cached one behind, through a ``.pth``): what a bootstrap installs lands there, so the cached
runtime stays as it was found, which the test checks. The notebooks run through
``python -m replaykit.workflow.colab`` (nbclient, parameters cell edited, a stand-in
``google.colab``, a kernel folder outside the repository, ``tree`` a ``pack`` archive, one
notebook through ``files.upload``), then evidence reads the downloaded notebooks.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tooling not installed")
pytest.importorskip("nbclient", reason="notebook tooling not installed")

from replaykit.workflow.evidence import EDITED, OK, collect  # noqa: E402 - after the importorskip guards

ROOT = Path(__file__).resolve().parents[2]
PINNED = Path(__file__).with_name("colab-runtime.txt")
TORCH = os.environ.get("REPLAYKIT_COLAB_TORCH", "torch==2.13.0")
"""The stand-in for Colab's CUDA torch: a CPU build (from local disk here)."""
NO_INDEX = r"(?i)connection|temporary failure|name resolution|network is unreachable"
BASE_PYTHON = os.environ.get("REPLAYKIT_COLAB_PYTHON")
"""Another interpreter for the runtime (Colab's is 3.13: ``REPLAYKIT_COLAB_PYTHON=python3.13`` where a
CPU torch for it can be installed); default: the one running the tests."""


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _purelib(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def _freeze(python: Path) -> list[str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
        env=_clean_env(),
    ).stdout
    return sorted(out.split())


def _clean_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }


@functools.cache
def _base() -> tuple[Path, str]:
    """(the interpreter that builds the runtime's venvs, its X.Y)."""
    python = Path(
        BASE_PYTHON
        or Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    )
    version = subprocess.run(
        [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return python, version


def _base_python() -> Path:
    return _base()[0]


def colab_runtime() -> Path:
    """The cached venv of Colab's preinstalled packages (built on first use: about a minute)."""
    version = _base()[1]
    key = hashlib.sha256(f"{PINNED.read_text()}\n{TORCH}\n{version}".encode()).hexdigest()[:12]
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "replaykit"
        / "colab-runtime"
    )
    venv = cache / f"py{version}-{key}"
    if (venv / ".complete").is_file():
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # an unfinished build
    subprocess.run([str(_base_python()), "-m", "venv", str(venv)], check=True)
    proc = subprocess.run(
        [str(_python(venv)), "-m", "pip", "install", "-q", TORCH, "-r", str(PINNED)],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    if proc.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        if re.search(NO_INDEX, proc.stderr):
            pytest.skip(
                f"no package index reachable to build the Colab runtime: {proc.stderr.strip()[-200:]}"
            )
        pytest.fail(f"could not build the Colab runtime venv: {proc.stderr[-2000:]}")
    (venv / ".complete").write_text("\n".join(_freeze(_python(venv))) + "\n")
    return venv


def runtime_for_this_session(base: Path, dest: Path) -> Path:
    """A venv whose own site-packages come first and the cached runtime's after (a ``.pth``): what
    the bootstraps install lands here (pip runs from the runtime, installs into this prefix)."""
    subprocess.run([str(_base_python()), "-m", "venv", "--without-pip", str(dest)], check=True)
    python = _python(dest)
    (Path(_purelib(python)) / "_colab_runtime.pth").write_text(_purelib(_python(base)) + "\n")
    return python


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = colab_runtime()
    return base, runtime_for_this_session(base, tmp_path_factory.mktemp("colab") / "runtime")


def test_the_parameters_cell_is_edited_as_a_user_edits_it() -> None:
    from replaykit.workflow.colab import edit_parameters

    nb = nbformat.read(ROOT / "notebooks" / "parity.ipynb", as_version=4)
    edit_parameters(nb, {"tasks": ["pose"], "tree": "upload", "with_unsafe": False})
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    lines = cell.source.splitlines()
    assert "tasks: list = ['pose']  # any of: detection, pose, oriented, segmentation" in lines
    assert any(line.startswith("tree: str = 'upload'  # ") for line in lines)
    assert any(line.startswith("with_unsafe: bool = False  # ") for line in lines)
    assert not [
        c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])
    ]  # nothing injected
    with pytest.raises(KeyError, match="declares no task"):
        edit_parameters(nb, {"task": ["pose"]})


@pytest.mark.env
def test_the_runtime_has_only_what_colab_preinstalls(runtime: tuple[Path, Path]) -> None:
    _, python = runtime
    code = (
        "import importlib.util as u, torch; print(torch.__version__, "
        "[m for m in ('lightning', 'junitparser', 'papermill', 'nbval', 'tqdm', 'replaykit') if u.find_spec(m)])"
    )
    out = subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=_clean_env(),
        cwd="/",
    )
    version, found = out.stdout.split(" ", 1)
    assert version.startswith(TORCH.split("==")[1]) and found == "[]\n", out.stdout


@pytest.mark.env
@pytest.mark.slow
def test_run_all_as_colab_then_evidence(runtime: tuple[Path, Path], tmp_path: Path) -> None:
    """Every notebook passes with CPU settings, one through the upload path; the downloaded notebooks
    are evidence on their own (sealed verdicts, per-part results); the cached runtime is unchanged."""
    from replaykit.workflow.archive import pack

    base, python = runtime
    before = _freeze(_python(base))
    archive = pack(ROOT, tmp_path / "dist").path
    downloads = tmp_path / "downloads"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replaykit.workflow.colab",
            str(archive),
            "--out",
            str(downloads),
            "--quick",
            "--python",
            str(python),
            "--upload",
            "hazards",
            "--notebooks-dir",
            str(ROOT / "notebooks"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    if (
        proc.returncode != 0
        and "pip could not install" in proc.stdout
        and re.search(NO_INDEX, proc.stdout)
    ):
        pytest.skip("no package index reachable for the bootstrap to install from")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    # the bootstrap said what it installed, from where, how long it took, and kept torch
    parity = nbformat.read(downloads / "parity.ipynb", as_version=4)
    said = "".join(
        o.get("text", "") for c in parity.cells if c.cell_type == "code" for o in c.outputs
    )
    torch_version = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        env=_clean_env(),
        cwd="/",
    ).stdout.strip()
    assert (
        "replaykit bootstrap: installing" in said
        and "lightning" in said
        # the bootstrap names the installed distribution's version: a CUDA build's local tag
        # ("+cu130", torch.__version__ only) is not in its metadata when it came from the index
        and re.search(rf"\(torch {re.escape(torch_version.split('+')[0])}(\+\w+)? kept\)", said)
    )
    assert "installed in " in said
    hazards = nbformat.read(downloads / "hazards.ipynb", as_version=4)
    assert "Saving replaykit-" in "".join(
        o.get("text", "") for o in hazards.cells[2].outputs
    )  # the upload path

    ev = collect(runs=[downloads])  # the downloads folder, as a Drive folder of notebooks
    by_name = {r.summary["notebook"]: r for r in ev.runs}
    assert set(by_name) == {"parity.ipynb", "hazards.ipynb", "benchmark.ipynb", "verify.ipynb"}
    for name, run in by_name.items():
        assert run.integrity == OK and run.summary["status"] == "passed", (
            name,
            run.result(),
            run.problems,
        )
        assert run.fingerprint["tree"]["commit"] and run.fingerprint["colab"] is True
    assert (
        "zoo 1/1" in by_name["parity.ipynb"].result()
        and "whole step 1/1" in by_name["parity.ipynb"].result()
    )
    assert (
        "passed" in by_name["verify.ipynb"].result()
        and "no tests ran" not in by_name["verify.ipynb"].result()
    )
    assert by_name["parity.ipynb"].summary["parameters"]["tasks"] == [
        "detection"
    ]  # as the user edited it
    assert (
        sorted(p.suffix for p in downloads.iterdir() if p.suffix == ".zip") == [".zip"] * 4
    )  # each run folder

    # an edited verdict is flagged, as for run folders
    edited = downloads / "hazards.ipynb"
    text = edited.read_text()
    assert '"status": "passed"' in text
    edited.write_text(text.replace('"status": "passed"', '"status": "failed"', 1))
    again = {r.summary["notebook"]: r for r in collect(folders=[downloads]).runs}
    assert again["hazards.ipynb"].integrity == EDITED

    assert _freeze(_python(base)) == before  # the cached runtime is as it was found
