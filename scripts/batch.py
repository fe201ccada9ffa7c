"""Run notebooks over environments × trees × parameter sets; one index per batch under runs/.

    python scripts/batch.py batch.json                      # a spec (JSON or YAML)
    python scripts/batch.py --env main=.venv/bin/python --venv t212=torch==2.12.0 \\
        --tree old=HEAD~5 --tree main --notebook notebooks/verify.ipynb -p markers cuda

A spec holds name, environments ({name, python} or {name, requirements, base_python,
system_site_packages, site_dirs, pip_args}), trees (revisions, folders or archives),
notebooks, parameters (a list of mappings), repo, cell_timeout, venvs_dir.
Prints the index path and one line per cell. Exit code: 0 every cell passed, 1 some cell
failed or errored, 2 bad input (spec, notebook, revision).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a tree that is not installed (an uploaded tree): import its own replaykit.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replaykit.workflow.batch import BatchSpec, Environment, TreeSpec, load_spec, run_batch
from replaykit.workflow.runs import cli_parameters


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", type=Path, help="batch spec (.json, .yaml); or use the options below")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=PYTHON",
                    help="an existing interpreter (repeatable)")
    ap.add_argument("--venv", action="append", default=[], metavar="NAME=REQUIREMENT",
                    help="a venv to build; repeat NAME for several requirements (NAME= for none)")
    ap.add_argument("--base-python", help="interpreter that builds the --venv environments")
    ap.add_argument("--system-site-packages", action="store_true", help="--venv environments see the base's packages")
    ap.add_argument("--tree", action="append", default=[], metavar="[LABEL=]REV_OR_PATH",
                    help="a git revision, folder or packed archive (repeatable)")
    ap.add_argument("--notebook", action="append", default=[], type=str, help="notebook (repeatable)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                    help="parameter, converted like papermill -p")
    ap.add_argument("-r", "--raw", nargs=2, action="append", metavar=("NAME", "VALUE"), help="string parameter")
    ap.add_argument("-y", "--yaml", action="append", metavar="YAML_OR_JSON", help="parameters as YAML/JSON")
    ap.add_argument("--name", default="batch", help="batch name (the folder's suffix)")
    ap.add_argument("--repo", default=".", help="repository the revisions come from")
    ap.add_argument("--cell-timeout", type=int, help="seconds before a cell is interrupted")
    ap.add_argument("--venvs-dir", help="where built venvs are kept (default ~/.cache/replaykit/venvs)")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _pair(text: str, flag: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"{flag} {text!r}: expected NAME={what}")
    return name, value


def spec_from_args(args: argparse.Namespace) -> BatchSpec:
    quick = args.env or args.venv or args.tree or args.notebook or args.parameter or args.raw or args.yaml
    if args.spec is not None:
        if quick:
            raise ValueError("give a spec file or --env/--venv/--tree/--notebook/-p, not both")
        return load_spec(args.spec)
    envs = [Environment(name=n, python=p) for n, p in (_pair(e, "--env", "PYTHON") for e in args.env)]
    venvs: dict[str, list[str]] = {}
    for item in args.venv:
        name, req = _pair(item, "--venv", "REQUIREMENT")
        venvs.setdefault(name, []).extend([req] if req else [])
    envs += [Environment(name=n, requirements=reqs, base_python=args.base_python,
                         system_site_packages=args.system_site_packages) for n, reqs in venvs.items()]
    if not envs:
        envs = [Environment(name="current", python=sys.executable)]
    return BatchSpec(
        environments=envs,
        notebooks=args.notebook,
        trees=[TreeSpec.parse(t) for t in args.tree],
        parameters=[cli_parameters(args.parameter, args.raw, args.yaml)],
        name=args.name,
        repo=args.repo,
        cell_timeout=args.cell_timeout,
        venvs_dir=args.venvs_dir,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        result = run_batch(spec, args.runs_dir, progress=not args.no_progress)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.index)
    print(result.table())
    print(", ".join(f"{n} {s}" for s, n in sorted(result.counts().items())))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
