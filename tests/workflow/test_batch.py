"""A batch: environments × trees × notebooks × parameters, real papermill runs on tiny notebooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="papermill tooling not installed")
pytest.importorskip("papermill", reason="papermill tooling not installed")

from replaykit.workflow import cli  # noqa: E402
from replaykit.workflow.batch import BatchSpec, load_spec, run_batch  # noqa: E402 - after the importorskip guards
from replaykit.workflow.cells import WRONG_INTERPRETER  # noqa: E402
from replaykit.workflow.environments import Environment  # noqa: E402
from replaykit.workflow.interpreters import same_interpreter  # noqa: E402
from replaykit.workflow.trees import TreeSpec  # noqa: E402

PROBE = """\
import json, pathlib, platform, sys
pathlib.Path(run_dir, "fingerprint.json").write_text(json.dumps({
    "executable": sys.executable, "python": platform.python_version(), "torch": None,
    "device": "cpu", "tree": {"path": tree}}))
version = pathlib.Path(tree, "VERSION").read_text().strip() if tree else None
pathlib.Path(run_dir, "results.json").write_text(json.dumps(
    {"counts": {"passed": 1}, "version": version, "prefix": sys.prefix}))
"""
LIAR = """\
import json, pathlib
pathlib.Path(run_dir, "fingerprint.json").write_text(json.dumps({"executable": "/elsewhere/bin/python"}))
"""


def make_notebook(path: Path, *cells: str, params: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(params, metadata={"tags": ["parameters"]}))
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)
    return path


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def make_repo(path: Path, versions: list[str]) -> Path:
    """A git repo with one commit per version (a VERSION file and a tests/ folder)."""
    (path / "tests").mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / "tests" / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    for v in versions:
        (path / "VERSION").write_text(v + "\n")
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", f"version {v}")
    return path


@pytest.fixture
def clean_jupyter_path() -> Iterator[None]:
    before = os.environ.get("JUPYTER_PATH")
    yield
    assert os.environ.get("JUPYTER_PATH") == before  # the batch restored it


def summary_of(folder: Path, cell: dict) -> dict:
    return json.loads((folder / cell["run_dir"] / "summary.json").read_text())


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
def test_two_environments_two_trees_with_failures(tmp_path: Path, clean_jupyter_path: None) -> None:
    repo = make_repo(tmp_path / "repo", ["one", "two"])
    (repo / "VERSION").write_text("worktree\n")  # the path tree is dirty: not what HEAD holds
    probe = make_notebook(
        tmp_path / "probe.ipynb", PROBE, "assert 1 / x", params='tree = ""\nx = 1\nrun_dir = ""'
    )
    second = Environment(
        name="second",
        requirements=[],
        system_site_packages=True,
        pip_args=["--no-index"],
        site_dirs=[sysconfig.get_paths()["purelib"]],  # reuse this venv's packages: no download
    )
    spec = BatchSpec(
        name="two envs",
        environments=[
            Environment(name="missing", python=str(tmp_path / "nowhere" / "python")),
            Environment(name="current", python=sys.executable),
            second,
        ],
        trees=[TreeSpec(label="old", rev="HEAD~1"), TreeSpec(label="work", path=str(repo))],
        notebooks=[str(probe)],
        parameters=[{"x": 1}, {"x": 0}],
        repo=str(repo),
        venvs_dir=str(tmp_path / "venvs"),
    )
    result = run_batch(spec, tmp_path / "runs", progress=False)

    assert result.folder.parent == tmp_path / "runs" and result.folder.name.startswith("batch_")
    assert result.folder.name.endswith("_two-envs")
    index = json.loads(result.index.read_text())
    assert (result.folder / "index.md").is_file()
    cells = index["cells"]
    assert len(cells) == 3 * 2 * 2 == len(result.cells)
    assert [(c["env"], c["tree"]["label"], c["parameters"]["x"]) for c in cells] == [
        (env, tree, x)
        for env in ("missing", "current", "second")
        for tree in ("old", "work")
        for x in (1, 0)
    ]
    assert index["counts"] == {"error": 4, "passed": 4, "failed": 4}

    missing = [c for c in cells if c["env"] == "missing"]
    assert all(c["status"] == "error" and c["reason"] == "env build failed" for c in missing)
    assert all(c["run_dir"] is None and "not found" in c["summary"] for c in missing)

    envs = {e["name"]: e for e in index["environments"]}
    built = envs["second"]["python"]
    assert envs["second"]["built"] and built.startswith(str(tmp_path / "venvs"))
    assert not same_interpreter(built, sys.executable)
    assert envs["current"]["kernel"] != envs["second"]["kernel"]
    for cell in cells:
        if cell["env"] == "missing":
            continue
        s = summary_of(result.folder, cell)
        expected = sys.executable if cell["env"] == "current" else built
        assert same_interpreter(s["kernel_executable"], expected) and s["kernel"] == cell["kernel"]
        assert same_interpreter(s["fingerprint"]["executable"], expected)  # the kernel ran there
        x = cell["parameters"]["x"]
        assert cell["status"] == ("passed" if x else "failed")
        if x:
            want = {"old": "one", "work": "worktree"}[cell["tree"]["label"]]
            assert s["results"]["version"] == want
        else:
            assert s["failed_cell"]["ename"] == "ZeroDivisionError"
        assert cell["sha256"] == s["sha256"] and cell["counts"] == {"passed": 1}

    old = index["trees"][0]
    assert old["source"] == "rev" and old["commit"] == git(repo, "rev-parse", "HEAD~1")
    assert old["dirty"] is False and old["short"] == old["commit"][:7]
    work = index["trees"][1]
    assert work["source"] == "path" and work["dirty"] is True
    assert "second" in result.table() and not result.ok

    # A second batch reuses the built venv (stamp) and registers a fresh private kernel.
    again = run_batch(
        BatchSpec(environments=[second], notebooks=[str(probe)], venvs_dir=str(tmp_path / "venvs")),
        tmp_path / "runs",
        progress=False,
    )
    assert again.environments[0]["python"] == built and again.environments[0]["setup_s"] < 5
    assert [c["tree"]["label"] for c in again.cells] == ["default"] and again.ok


def test_a_run_under_another_interpreter_is_an_error(tmp_path: Path) -> None:
    liar = make_notebook(tmp_path / "liar.ipynb", LIAR, params='run_dir = ""')
    spec = BatchSpec(
        environments=[Environment(name="current", python=sys.executable)], notebooks=[str(liar)]
    )
    result = run_batch(spec, tmp_path / "runs", progress=False)
    (cell,) = result.cells
    assert (cell["status"], cell["reason"]) == ("error", WRONG_INTERPRETER)
    assert "/elsewhere/bin/python" in cell["summary"] and cell["run_dir"]  # the run is kept
    from replaykit.workflow.evidence import collect

    ev = collect(batches=[result.index])
    assert ev.runs[0].result() == f"passed (error: {WRONG_INTERPRETER})"
    assert any("/elsewhere/bin/python" in w for w in ev.warnings)


def test_spec_files_and_bad_input(tmp_path: Path) -> None:
    nb = make_notebook(tmp_path / "nb.ipynb", "pass", params='run_dir = ""')
    data = {
        "name": "spec",
        "environments": [
            {"name": "here", "python": sys.executable},
            {"name": "venv", "requirements": ["six"], "system_site_packages": True},
        ],
        "trees": ["HEAD", {"label": "here", "path": str(tmp_path)}],
        "notebooks": [str(nb)],
        "parameters": {"x": 1},
    }
    (tmp_path / "spec.json").write_text(json.dumps(data))
    (tmp_path / "spec.yaml").write_text(
        "name: spec\nenvironments:\n  - {name: here, python: python3}\nnotebooks: [nb.ipynb]\n"
    )
    spec = load_spec(tmp_path / "spec.json")
    assert [e.built for e in spec.environments] == [False, True]
    assert spec.environments[1].requirements == ("six",)
    assert spec.trees == [TreeSpec(rev="HEAD"), TreeSpec(label="here", path=str(tmp_path))]
    assert spec.parameters == [{"x": 1}]
    assert load_spec(tmp_path / "spec.yaml").environments[0].python == "python3"

    assert TreeSpec.parse("base=HEAD~2") == TreeSpec(label="base", rev="HEAD~2")
    assert TreeSpec.parse(str(tmp_path)) == TreeSpec(path=str(tmp_path))
    bad = [
        ({**data, "bogus": 1}, "unknown batch spec keys: bogus"),
        ({**data, "environments": [{"name": "x"}]}, "exactly one of python or requirements"),
        (
            {**data, "environments": [{"name": "x", "python": "p", "system_site_packages": True}]},
            "built venv",
        ),
        (
            {**data, "environments": [{"name": "x", "python": "p", "color": 1}]},
            "environments.0.: .*color",
        ),
        ({**data, "environments": [{"name": "x", "requirements": "torch"}]}, "must be a list"),
        ({**data, "environments": []}, "at least one environment"),
        ({**data, "trees": ["a=HEAD", "a=HEAD~1"]}, "repeated: a"),
        ({**data, "parameters": [{"tree": "x"}]}, "'tree' is set by the batch"),
        ({**data, "parameters": [{"run_dir": "x"}]}, "'run_dir' is set by the runner"),
    ]
    for spec_data, message in bad:
        with pytest.raises(ValueError, match=message):
            BatchSpec.from_dict(spec_data)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_spec(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError):
        load_spec(tmp_path / "absent.json")
    here = [Environment(name="here", python=sys.executable)]
    with pytest.raises(FileNotFoundError, match="notebook not found"):
        run_batch(
            BatchSpec(environments=here, notebooks=[str(tmp_path / "no.ipynb")]), tmp_path / "r"
        )
    repo = make_repo(tmp_path / "repo", ["one"])
    with pytest.raises(ValueError, match="not a commit"):
        run_batch(
            BatchSpec(
                environments=here, notebooks=[str(nb)], trees=[TreeSpec(rev="nope")], repo=str(repo)
            ),
            tmp_path / "r",
        )
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").iterdir())  # nothing ran


@pytest.mark.slow  # a batch of notebook runs, a kernel each
def test_cli_quick_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nb = make_notebook(tmp_path / "nb.ipynb", "assert x == 1", params='x = 0\nrun_dir = ""')
    args = [
        "--env",
        f"here={sys.executable}",
        "--notebook",
        str(nb),
        "--runs-dir",
        str(tmp_path / "runs"),
        "--no-progress",
    ]
    assert cli.batch([*args, "-p", "x", "1", "--name", "quick"]) == 0
    out = capsys.readouterr().out
    assert "index.json" in out and "passed" in out
    assert cli.batch([*args, "-p", "x", "2"]) == 1
    assert cli.batch(["--env", "broken", "--notebook", str(nb)]) == 2
    assert "NAME=PYTHON" in capsys.readouterr().err
    # a misspelled parameter (papermill would only warn and run the defaults) is refused before anything runs
    assert cli.batch([*args, "-p", "y", "1", "--name", "typo"]) == 2
    assert "nb.ipynb declares no parameter 'y'; it declares: x, run_dir" in capsys.readouterr().err
    assert not list((tmp_path / "runs").glob("batch_*_typo"))
    assert cli.batch([*args, "-y", "{x: [1,"]) == 2  # bad YAML: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: -y '{x: [1,': not valid YAML/JSON (") and "line 1, column" in err
    assert len(err.strip().splitlines()) == 1


def test_notebooks_with_their_own_parameters_share_one_batch(tmp_path: Path) -> None:
    """verify.ipynb takes markers, parity.ipynb does not: each notebook can carry its own parameter sets."""
    one = make_notebook(tmp_path / "one.ipynb", "assert x == 1", params='x = 0\nrun_dir = ""')
    two = make_notebook(tmp_path / "two.ipynb", "assert y == 'b'", params='y = "a"\nrun_dir = ""')
    data = {
        "name": "mixed",
        "environments": [{"name": "here", "python": sys.executable}],
        "notebooks": [str(one), {"path": str(two), "parameters": [{"y": "b"}]}],
        "parameters": [{"x": 1}],
    }
    spec = BatchSpec.from_dict(data)
    assert spec.notebooks == [str(one), str(two)]
    assert spec.parameters_of(str(one)) == [{"x": 1}] and spec.parameters_of(str(two)) == [
        {"y": "b"}
    ]
    result = run_batch(spec, tmp_path / "runs", progress=False)
    assert [(Path(c["notebook"]).name, c["parameters"], c["status"]) for c in result.cells] == [
        ("one.ipynb", {"x": 1}, "passed"),
        ("two.ipynb", {"y": "b"}, "passed"),
    ]
    with pytest.raises(ValueError, match="path and parameters"):
        BatchSpec.from_dict({**data, "notebooks": [{"file": str(two)}]})
    with pytest.raises(ValueError, match="'run_dir' is set by the runner"):
        BatchSpec.from_dict(
            {**data, "notebooks": [{"path": str(two), "parameters": {"run_dir": "x"}}]}
        )
    with pytest.raises(ValueError, match="not in the batch"):
        BatchSpec(
            environments=spec.environments,
            notebooks=[str(one)],
            notebook_parameters={"other.ipynb": [{}]},
        )
