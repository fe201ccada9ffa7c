"""The core imports only torch; the workflow imports no torch of its own; the packaging says so."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "replaykit"
# what `import replaykit` must not pull in (each belongs to an extra, or to another layer)
NOT_IN_CORE = (
    "papermill",
    "pandas",
    "matplotlib",
    "lightning",
    "yaml",
    "nbformat",
    "ipywidgets",
    "junitparser",
)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


FRESH = """
import json, sys
import replaykit as rk
seen = {"torch_after_import": "torch" in sys.modules}
rk.capture, rk.enable_determinism
seen["torch_after_first_use"] = "torch" in sys.modules
seen["after_capture"] = sorted(sys.modules)
seen["all_listed"] = set(rk.__all__) <= set(dir(rk))
seen["missing"] = [n for n in rk.__all__ if getattr(rk, n, None) is None]
from replaykit import TrainStep, capture
seen["same_objects"] = capture is rk.capture and TrainStep is rk.TrainStep
try:
    rk.no_such_name
    seen["unknown_raises"] = False
except AttributeError:
    seen["unknown_raises"] = True
import torch
m = torch.nn.Linear(3, 3); rk.capture(m, backend="emulated")
m(torch.randn(2, 3)).sum().backward()
opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
step = rk.TrainStep(torch.nn.Linear(3, 3), lambda m, x: m(x).sum(), opt, backend="emulated", warmup=0)
seen["after_recording"] = sorted(sys.modules)
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def fresh() -> dict[str, Any]:
    """What one new interpreter saw at each point of FRESH, in the order the three tests below need:
    ``import replaykit`` alone, first use of two names, every exported name, a recording and a whole
    step. Each point only adds modules, so none hides one a later check looks for; one child serves
    the three (each imported torch again: seconds on a loaded machine)."""
    out = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow  # the first to ask for `fresh`: a new interpreter imports torch, records, steps
def test_import_replaykit_pulls_in_no_extra(fresh: dict[str, Any]) -> None:
    modules = fresh["after_capture"]
    assert not {m for m in modules if m.split(".")[0] in NOT_IN_CORE}
    assert not {
        m
        for m in modules
        if m.startswith(("replaykit.testing", "replaykit.workflow", "replaykit.lightning"))
    }


def test_the_package_root_is_lazy_and_still_exports_everything(fresh: dict[str, Any]) -> None:
    """``import replaykit`` loads no core module; each exported name loads its own on first use."""
    assert not fresh["torch_after_import"], "import replaykit loaded torch"
    assert fresh["torch_after_first_use"]
    assert fresh["all_listed"] and fresh["missing"] == []
    assert fresh["same_objects"] and fresh["unknown_raises"]


WORKFLOW_MODULES = sorted(
    f"replaykit.workflow.{p.stem}" if p.stem != "__init__" else "replaykit.workflow"
    for p in (PACKAGE / "workflow").glob("*.py")
    if p.stem != "__main__"  # __main__ runs the command
)


@pytest.mark.parametrize("module", WORKFLOW_MODULES)
def test_a_workflow_module_loads_without_torch(module: str) -> None:
    """The workflow runs where torch is absent or slow to load (a bare runner, a Colab bootstrap cell)."""
    assert "torch" not in _modules_after(f"import {module}")


def test_the_bootstrap_module_loads_by_path_without_torch() -> None:
    """A notebook's first cell loads bootstrap.py by path, before replaykit is importable."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rk_bootstrap', {str(PACKAGE / 'workflow' / 'bootstrap.py')!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)"
    )
    modules = _modules_after(code)
    assert "torch" not in modules and "replaykit" not in modules


def _imported_roots(path: Path, at_import: bool = False) -> set[str]:
    """Top-level names a module imports; ``at_import``: only those its import runs (not inside a function)."""
    roots = set()
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if at_import:
        nodes = [
            n
            for top in tree.body
            if not isinstance(top, (ast.FunctionDef, ast.ClassDef))
            for n in ast.walk(top)
        ]
    for node in nodes:
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_workflow_module_imports_torch() -> None:
    for path in sorted((PACKAGE / "workflow").rglob("*.py")):
        assert not _imported_roots(path, at_import=True) & {"torch", "lightning"}, path


def test_the_core_imports_only_torch() -> None:
    core = [
        p
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0]
        not in ("testing", "workflow", "lightning", "integrations")
    ]
    third_party = (
        set().union(*map(_imported_roots, core)) - set(sys.stdlib_module_names) - {"replaykit"}
    )
    assert third_party == {"torch"}


def test_an_integration_imports_only_torch_and_its_library() -> None:
    """``replaykit.integrations.<library>`` is loaded by the core only when that library is imported already."""
    from replaykit.verify.contexts import INTEGRATIONS

    for path in sorted((PACKAGE / "integrations").glob("*.py")):
        roots = _imported_roots(path) - set(sys.stdlib_module_names) - {"replaykit"}
        assert roots <= {"torch", path.stem}, path
    assert {f"replaykit.integrations.{p.stem}" for p in (PACKAGE / "integrations").glob("*.py")} - {
        "replaykit.integrations.__init__"
    } == set(INTEGRATIONS.values())


def test_recording_imports_no_library_that_is_not_imported(fresh: dict[str, Any]) -> None:
    """A recording loads an integration only for a library the user imported (transformers is not pulled in)."""
    modules = fresh["after_recording"]
    assert "transformers" not in modules and "replaykit.integrations.transformers" not in modules


# the distribution that provides each import root
DISTRIBUTIONS = {
    "torch": "torch",
    "lightning": "lightning",
    "tqdm": "tqdm",
    "papermill": "papermill",
    "nbformat": "nbformat",
    "nbclient": "nbclient",
    "ipykernel": "ipykernel",
    "jupyter_client": "jupyter_client",
    "yaml": "pyyaml",
    "junitparser": "junitparser",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
    "ipywidgets": "ipywidgets",
    "IPython": "ipykernel",  # ipykernel depends on ipython
    "google": "ipykernel",  # google.colab: present only in Colab, imported only there
}


def test_dependencies_are_torch_only_and_every_import_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch>=2.4"]
    extras = project["optional-dependencies"]
    assert {"lightning", "testing", "workflow", "notebooks", "dev"} <= extras.keys()
    declared = {"torch"} | {
        req.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        for reqs in extras.values()
        for req in reqs
    }
    used = (
        set().union(*map(_imported_roots, PACKAGE.rglob("*.py")))
        - set(sys.stdlib_module_names)
        - {"replaykit"}
    )
    undeclared = {root for root in used if DISTRIBUTIONS.get(root, root).lower() not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"


def test_every_package_on_disk_is_listed_for_the_wheel() -> None:
    """pyproject.toml lists the packages (the notebooks map in from notebooks/): a new one must be added there."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"replaykit.workflow.notebooks"}
    assert setuptools["package-dir"] == {"replaykit.workflow.notebooks": "notebooks"}
