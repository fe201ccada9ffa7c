"""The README's recipes as written (and docs/workflow.md's, the full workflow it points to): every
command line is exercised, the offline one end to end.

Placeholders (``<good>``, ``<bad>``, ``<rev>``, ``<commit>``, ``<UTC>``) are replaced by real values of
this checkout. Commands too heavy for CI (``make demo``, a bisect over CUDA tests) are checked as
far as they can be without running them: the make target exists (``make -n``), the script's
parser accepts the documented arguments, and a notebook declares the ``-p`` parameters passed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = "\n".join((ROOT / page).read_text() for page in ("README.md", "docs/workflow.md"))
OFFLINE_MARK = "tar xzf"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^ *```{lang}\n(.*?)^ *```", README, flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    """Lines of a bash block, continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def placeholders() -> dict[str, str]:
    head = git("rev-parse", "--short=7", "HEAD")
    return {
        "<good>": git("rev-parse", "--short=7", "HEAD~1"),
        "<bad>": head,
        "<rev>": head,
        "<commit>": head,
        "<UTC>": "20260101T000000Z",
    }


def substitute(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    assert not re.search(r"<[a-zA-Z]+>", text), f"unknown placeholder in {text!r}"
    return text


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"readme_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser(stem: str):
    """The argument parser behind a scripts/ shim (they all dispatch to replaykit.workflow.cli)."""
    from replaykit.workflow import archive, cli

    parsers = {
        "run_notebook": cli.run_parser,
        "batch": cli.batch_parser,
        "verify_tree": cli.verify_parser,
        "evidence": cli.evidence_parser,
        "bisect_commits": cli.bisect_parser,
        "pack": archive.build_parser,
    }
    return parsers[stem]() if stem in parsers else load_script(stem).build_parser()


def check_python(argv: list[str]) -> None:
    """``python scripts/x.py ...`` or ``python -m module ...``: the parser accepts the documented
    arguments, and ``-p``/``-y`` parameters are ones the notebook declares."""
    if argv[0] == "-m":
        module = importlib.import_module(argv[1])
        if argv[1] == "replaykit.workflow":
            argv = [
                "scripts/"
                + {"run": "run_notebook", "verify": "verify_tree", "bisect": "bisect_commits"}.get(
                    argv[2], argv[2]
                )
                + ".py",
                *argv[3:],
            ]
        else:
            module.build_parser().parse_args(argv[2:])
            return
    script = Path(argv[0])
    assert (ROOT / script).is_file() or script.parts[0].startswith("replaykit-"), (
        f"no such script: {script}"
    )
    args = _parser(script.stem).parse_args(argv[1:])
    params = getattr(args, "parameter", None)
    notebooks = (
        [args.notebook] if script.stem == "run_notebook" else getattr(args, "notebook", None) or []
    )
    if params or getattr(args, "yaml", None):
        from replaykit.workflow.runs import check_parameters, cli_parameters

        for nb in notebooks:
            check_parameters(
                ROOT / nb, cli_parameters(params, getattr(args, "raw", None), args.yaml)
            )


def check_pip_install(args: list[str]) -> None:
    """``pip install .`` or ``'.[extra,...]'``: this checkout, with extras pyproject.toml declares."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    declared = re.findall(r"^([\w-]+) = \[", section.split("\n[")[0], flags=re.M)
    (target,) = args
    match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert match, f"pip install of something other than this checkout: {target}"
    for extra in filter(None, (match.group(1) or "").split(",")):
        assert extra in declared, f"pip install {target}: no extra {extra!r} in pyproject.toml"


def test_every_bash_line_of_the_readme_is_exercised() -> None:
    values = placeholders()
    seen = 0
    for block in blocks("bash"):
        if OFFLINE_MARK in block:
            continue  # run for real by test_offline_recipe_end_to_end
        for line in command_lines(substitute(block, values)):
            for part in (p.strip() for p in line.split("&&")):
                argv = shlex.split(part, comments=True)
                if argv[0] == "make":
                    proc = subprocess.run(
                        ["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True
                    )
                    assert proc.returncode == 0, f"{part}: {proc.stderr}"
                elif argv[0] == "source":
                    assert (
                        argv[1] == ".venv/bin/activate"
                        and "VENV ?= .venv" in (ROOT / "Makefile").read_text()
                    )
                elif argv[0] == "python":
                    check_python(argv[1:])
                elif argv[:2] == ["pip", "install"]:
                    check_pip_install(argv[2:])
                else:
                    raise AssertionError(f"README command not exercised by this test: {part}")
                seen += 1
    assert seen >= 15


def test_the_batch_spec_example_loads() -> None:
    from replaykit.workflow.batch import BatchSpec

    (example,) = [b for b in blocks("json") if '"environments"' in b]
    spec = BatchSpec.from_dict(json.loads(substitute(example, placeholders())))
    from replaykit.workflow.runs import check_parameters

    for nb in spec.notebooks:
        for params in spec.parameters:
            check_parameters(ROOT / nb, params)


# The README's own-code example (rk.capture on the emulated backend) runs as written, and prints the
# counts its comment says, in tests/core/test_readme_examples.py.


# --- the offline recipe -------------------------------------------------------


def _closure(names: list[str]) -> list[metadata.Distribution]:
    """These distributions and everything they require (without extras), as installed here."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def torch_only_venv(dest: Path) -> Path:
    """A venv that sees only torch and lightning (and what they require) and pip, linked from this
    environment: the offline host of the recipe, without downloading torch again (nor running
    ensurepip: 3-4 s)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    farm = dest / "linked"
    farm.mkdir()
    for dist in _closure(["torch", "lightning", "pip"]):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if (
                src.exists()
                and not (farm / top).exists()
                and not top.endswith((".pth", "__pycache__"))
            ):
                (farm / top).symlink_to(src)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "_linked.pth").write_text(str(farm) + "\n")
    return python


@pytest.mark.env
@pytest.mark.slow
def test_offline_recipe_end_to_end(tmp_path: Path) -> None:
    """pack --wheelhouse -> copy -> tar -> --verify -> the printed install line -> the verify notebook,
    in a venv holding only torch and lightning. The failure this guards: `No module named 'pandas'`."""
    python_version = sysconfig.get_python_version()
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/pack.py",
            "--wheelhouse",
            "--python",
            python_version,
            "--out",
            str(dist),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 and re.search(
        r"(?i)connection|resolve|network|temporary failure", proc.stderr
    ):
        pytest.skip(
            f"no package index reachable to build the wheelhouse: {proc.stderr.strip()[-200:]}"
        )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines()[1:] if " " in line)
    top = lines["top"].rstrip("/")
    archive = Path(proc.stdout.splitlines()[0])
    recipe = [
        line.split(None, 1)[1]
        for line in proc.stdout.splitlines()
        if line.startswith("offline ") and "copy " not in line
    ]
    host = tmp_path / "host"
    host.mkdir()
    (host / archive.name).write_bytes(archive.read_bytes())  # "copy the archive over", as named
    venv_python = torch_only_venv(tmp_path / "venv")
    assert (
        subprocess.run([str(venv_python), "-c", "import pandas"], capture_output=True).returncode
        != 0
    )

    (block,) = [b for b in blocks("bash") if OFFLINE_MARK in b]
    block = block.replace("-py3.12.", f"-py{python_version}.")  # the README's target, this Python
    commands = command_lines(substitute(block, {"<commit>": top.removeprefix("replaykit-")}))
    assert [shlex.split(c) for c in commands] == [shlex.split(c) for c in recipe], (
        "the README's offline recipe is not the one pack.py prints"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "JUPYTER_PATH")
    }
    env |= {
        "PATH": f"{venv_python.parent}{os.pathsep}{env['PATH']}",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "JUPYTER_DATA_DIR": str(tmp_path / "jupyter"),
        "MPLBACKEND": "Agg",
    }
    results = []
    for command in commands:
        run = subprocess.run(
            ["bash", "-c", command], cwd=host, env=env, capture_output=True, text=True, timeout=900
        )
        results.append(run)
        if command is not commands[-1]:
            assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    last = results[-1]
    assert "No module named" not in last.stdout + last.stderr, last.stdout[-2000:]
    gpu = (
        subprocess.run(
            [str(venv_python), "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "True"
    )
    if gpu:
        assert last.returncode == 0, last.stdout[-2000:]
    else:  # the cuda tests skip on a CPU: the notebook ran them all and says so
        assert last.returncode == 1 and "no tests ran" in last.stdout, (
            last.stdout[-3000:] + last.stderr[-2000:]
        )
