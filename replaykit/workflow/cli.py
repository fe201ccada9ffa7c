# One module: the six commands share option groups and one dispatcher; each is a parser and a short main.
"""The workflow's commands: ``replaykit-workflow COMMAND ...`` = ``python -m replaykit.workflow COMMAND ...``.

    pack      pack a tree (or a revision) into one verified archive; --verify one
    run       run one notebook through papermill into runs/<UTC>_<device>_torch<ver>_<tree>/
    batch     environments x trees x notebooks x parameter sets, one index per batch
    verify    a pytest selection against a tree: repeats, failing ids alone, a verdict per id
    evidence  the Markdown evidence of notebook runs, each notebook checked against its sha256
    bisect    the first commit that fails a selection; or --arm LABEL=TREE side by side

``scripts/*.py`` are shims over these (none imports torch: the package root is lazy).
Every command returns its exit code: 0 ok, 1 a failure it found, 2 bad arguments or input,
130 interrupted (Ctrl-C). Bad input is refused in one line on stderr before anything is written,
and before papermill or nbformat is imported (``inputs``: seconds saved on every typo).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from replaykit.workflow import archive, inputs
from replaykit.workflow.errors import RunInterrupted

__all__ = ["COMMANDS", "main", "notebook_arg"]

PROG = "replaykit-workflow"
_RAW = argparse.RawDescriptionHelpFormatter


def _parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{PROG} {command}", description=doc, formatter_class=_RAW)


def _parameter_options(ap: argparse.ArgumentParser) -> None:
    """-p/-r/-y, read by ``runs.cli_parameters``."""
    for short, name, what in (
        ("-p", "--parameter", "converted like papermill -p (int, float, True/False/None, str)"),
        ("-r", "--raw", "kept as a string"),
    ):
        ap.add_argument(
            short,
            name,
            nargs=2,
            action="append",
            metavar=("NAME", "VALUE"),
            help=f"parameter {what}",
        )
    ap.add_argument(
        "-y",
        "--yaml",
        action="append",
        metavar="YAML_OR_JSON",
        help="parameters as YAML/JSON text or a file holding it (lists, dicts)",
    )


def markers_and_ids(ap: argparse.ArgumentParser, markers: str, ids: str) -> None:
    """-m/--markers (default cuda) and the repeatable --id: the pytest selection every runner takes."""
    ap.add_argument("-m", "--markers", default="cuda", help=markers)
    ap.add_argument("--id", action="append", dest="ids", default=[], metavar="NODE_ID", help=ids)


def _selection_options(ap: argparse.ArgumentParser) -> None:
    """-m/--id/--repeats and pytest's own arguments after ``--``: what verify and bisect select."""
    markers_and_ids(
        ap, "pytest -m expression; '' for none (default: cuda)", "a test id to select (repeatable)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of the whole selection (per tree)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("extra", nargs="*", help="more pytest arguments, after --")


def notebook_arg(text: str) -> str:
    """A notebook path as given; else, for a bare name (``verify``, ``parity.ipynb``), the workflow's own notebook."""
    if Path(text).exists() or "/" in text or "\\" in text:
        return text
    from replaykit.workflow.fingerprint import notebook_path

    name = text if text.endswith(".ipynb") else f"{text}.ipynb"
    try:
        return str(notebook_path(name))
    except FileNotFoundError:
        return text  # the runner says it is missing


# --- run ---------------------------------------------------------------------


RUN_DOC = """Run one notebook through papermill into runs/<time>_<device>_torch<ver>_<tree>/.

    replaykit-workflow run notebooks/parity.ipynb -y '{tasks: [detection], precisions: ["32"]}'
    replaykit-workflow run verify -p tree dist/replaykit-<commit>.tar.gz   # a bare name: the shipped notebook

Prints the run folder and a one-line summary. Exit code: 0 passed, 1 failed (a cell
raised or timed out), 2 error (kernel died, runner error, bad arguments).
"""


def run_parser() -> argparse.ArgumentParser:
    ap = _parser("run", RUN_DOC)
    ap.add_argument(
        "notebook", type=notebook_arg, help="a .ipynb path, or parity / verify / benchmark"
    )
    _parameter_options(ap)
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument("--kernel", help="kernelspec name (default: register this interpreter)")
    ap.add_argument("--cell-timeout", type=int, help="seconds before a cell is interrupted")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--tree", type=Path, help="tree whose commit the fingerprint records")
    ap.add_argument("--cwd", type=Path, help="kernel working directory (default: here)")
    return ap


def _check_run(args: argparse.Namespace) -> None:
    """What ``run`` can refuse before importing papermill: tools, notebook, tree, folders."""
    inputs.needs("run", "papermill", "nbclient", "nbformat", "yaml")
    inputs.notebook(args.notebook)
    for flag, path in (("--tree", args.tree), ("--cwd", args.cwd)):
        if path is not None and not path.exists():
            raise FileNotFoundError(f"{flag} {path}: no such folder")


def tree_under_test(tree: Path | None, params: dict) -> Path | None:
    """The tree a run folder is named after: ``--tree``, else the notebook's ``tree`` parameter
    when it is a local archive or folder (the run tests that tree, not this checkout), else None
    (this checkout; a git URL's commit is known only once the notebook fetched it)."""
    if tree is not None:
        return tree
    local = params.get("tree")
    if isinstance(local, str) and local and Path(local).exists():
        return Path(local)
    return None


def run(argv: list[str] | None = None) -> int:
    args = run_parser().parse_args(argv)
    try:
        _check_run(args)
        from replaykit.workflow.runs import cli_parameters

        params = cli_parameters(args.parameter, args.raw, args.yaml)
        inputs.tree_value(params.get("tree"))
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from replaykit.workflow.runs import run_notebook, summary_line

    try:
        result = run_notebook(
            Path(args.notebook),
            params,
            runs_dir=args.runs_dir,
            kernel_name=args.kernel,
            cell_timeout=args.cell_timeout,
            progress=not args.no_progress,
            tree=tree_under_test(args.tree, params),
            cwd=args.cwd,
        )
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:
        print(f"interrupted: the partial notebook is saved: {exc.notebook}", file=sys.stderr)
        return 130
    print(result.run_dir)
    print(summary_line(result.summary))
    return {"passed": 0, "failed": 1}.get(result.summary["status"], 2)


# --- batch -------------------------------------------------------------------


BATCH_DOC = """Run notebooks over environments × trees × parameter sets; one index per batch under runs/.

    replaykit-workflow batch batch.json                      # a spec (JSON or YAML)
    replaykit-workflow batch --env main=.venv/bin/python --venv t212=torch==2.12.0 \\
        --tree old=HEAD~5 --tree main --notebook notebooks/verify.ipynb -p markers cuda

A spec holds name, environments ({name, python} or {name, requirements, base_python,
system_site_packages, site_dirs, pip_args}), trees (revisions, folders or archives),
notebooks, parameters (a list of mappings), repo, cell_timeout, venvs_dir.
Prints the index path and one line per cell. Exit code: 0 every cell passed, 1 some cell
failed or errored, 2 bad input (spec, notebook, revision).
"""


def batch_parser() -> argparse.ArgumentParser:
    ap = _parser("batch", BATCH_DOC)
    ap.add_argument(
        "spec", nargs="?", type=Path, help="batch spec (.json, .yaml); or use the options below"
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="an existing interpreter (repeatable)",
    )
    ap.add_argument(
        "--venv",
        action="append",
        default=[],
        metavar="NAME=REQUIREMENT",
        help="a venv to build; repeat NAME for several requirements (NAME= for none)",
    )
    ap.add_argument("--base-python", help="interpreter that builds the --venv environments")
    ap.add_argument(
        "--system-site-packages",
        action="store_true",
        help="--venv environments see the base's packages",
    )
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="[LABEL=]REV_OR_PATH",
        help="a git revision, folder or packed archive (repeatable)",
    )
    ap.add_argument(
        "--notebook",
        action="append",
        default=[],
        type=notebook_arg,
        help="notebook: a path, or parity / verify / benchmark (repeatable)",
    )
    _parameter_options(ap)
    ap.add_argument("--name", default="batch", help="batch name (the folder's suffix)")
    ap.add_argument("--repo", default=".", help="repository the revisions come from")
    ap.add_argument("--cell-timeout", type=int, help="seconds before a cell is interrupted")
    ap.add_argument(
        "--venvs-dir", help="where built venvs are kept (default ~/.cache/replaykit/venvs)"
    )
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _pair(text: str, flag: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"{flag} {text!r}: expected NAME={what}")
    return name, value


def spec_from_args(args: argparse.Namespace):  # -> batch.BatchSpec
    """The batch spec: the file given, or one built from --env/--venv/--tree/--notebook/-p."""
    from replaykit.workflow.batch import BatchSpec, load_spec
    from replaykit.workflow.environments import Environment
    from replaykit.workflow.runs import cli_parameters
    from replaykit.workflow.trees import TreeSpec

    quick = (
        args.env
        or args.venv
        or args.tree
        or args.notebook
        or args.parameter
        or args.raw
        or args.yaml
    )
    if args.spec is not None:
        if quick:
            raise ValueError("give a spec file or --env/--venv/--tree/--notebook/-p, not both")
        return load_spec(args.spec)
    envs = [
        Environment(name=n, python=p) for n, p in (_pair(e, "--env", "PYTHON") for e in args.env)
    ]
    venvs: dict[str, list[str]] = {}
    for item in args.venv:
        name, req = _pair(item, "--venv", "REQUIREMENT")
        venvs.setdefault(name, []).extend([req] if req else [])
    envs += [
        Environment(
            name=n,
            requirements=reqs,
            base_python=args.base_python,
            system_site_packages=args.system_site_packages,
        )
        for n, reqs in venvs.items()
    ]
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


def _check_batch(spec) -> None:  # spec: batch.BatchSpec
    """What ``batch`` can refuse before it writes a folder: interpreters, notebooks, trees."""
    for env in spec.environments:
        if env.python is not None:
            inputs.interpreter(str(env.python), f"environment {env.name}")
        if env.base_python is not None:
            inputs.interpreter(str(env.base_python), f"environment {env.name}: base_python")
    for nb in spec.notebooks:
        inputs.notebook(nb)
        for params in spec.parameters_of(nb):
            inputs.tree_value(params.get("tree"), f"{nb}: tree")


def batch(argv: list[str] | None = None) -> int:
    args = batch_parser().parse_args(argv)
    try:
        inputs.needs("batch", "papermill", "nbclient", "nbformat", "yaml")
        spec = spec_from_args(args)
        _check_batch(spec)
        from replaykit.workflow.batch import run_batch

        result = run_batch(spec, args.runs_dir, progress=not args.no_progress)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.index)
    print(result.table())
    tally = ", ".join(f"{n} {s}" for s, n in sorted(result.counts().items()))
    if rows_skipped := sum(int(c.get("skipped") or 0) for c in result.cells):
        tally += f" ({rows_skipped} rows or tests skipped: not a full pass)"
    print(tally)
    return 0 if result.ok else 1


# --- verify ------------------------------------------------------------------


VERIFY_DOC = """Run a pytest selection against a tree (this checkout, a directory or a packed archive).

    replaykit-workflow verify --tree tree.tar.gz -m cuda --repeats 3
    replaykit-workflow verify --id tests/core/test_hold.py::test_x --no-isolate -- -x

Prints the per-id table (r1…rN, alone, stable), the failures and pytest's summary lines.
Exit code: 0 when every selected test passed (or skipped) in every repeat, 1 otherwise,
2 when the tree is unusable (missing, corrupted archive, manifest mismatch).
"""


def verify_parser() -> argparse.ArgumentParser:
    ap = _parser("verify", VERIFY_DOC)
    ap.add_argument(
        "--tree", default="", help="directory or .tar.gz/.tgz/.tar (default: this checkout)"
    )
    ap.add_argument("--no-isolate", action="store_true", help="do not rerun each failing id alone")
    ap.add_argument(
        "--out",
        type=Path,
        help="folder for junit XML, logs and an extracted archive "
        "(default: a new temporary folder)",
    )
    ap.add_argument("--timeout", type=float, help="seconds before one pytest run is killed")
    _selection_options(ap)
    return ap


def verify(argv: list[str] | None = None) -> int:
    from replaykit.workflow import tables
    from replaykit.workflow.verify import resolve_tree, run_selection

    args = verify_parser().parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="replaykit-verify-"))
    try:
        tree = resolve_tree(args.tree, out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tree: {tree}\nout: {out}")
    selection = run_selection(
        tree,
        markers=args.markers or None,
        ids=args.ids,
        repeats=args.repeats,
        isolate_failures=not args.no_isolate,
        extra_args=args.extra,
        out_dir=out,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    table = selection.table()
    print(tables.text(table.to_dict("records"), list(table.columns)))
    failures = selection.failures()
    if len(failures):
        print("\nfailures:")
        print(tables.text(failures.to_dict("records"), list(failures.columns)))
    print()
    print("\n".join(selection.summary_lines()))
    for line in selection.run_errors():
        print(f"run error: {line}")
    print(f"outcome: {selection.outcome_line()}")
    return 0 if selection.ok else 1


# --- evidence ----------------------------------------------------------------


EVIDENCE_DOC = """Print the evidence of notebook runs as Markdown, ready to paste into an engineering log.

    replaykit-workflow evidence                                   # every run under runs/
    replaykit-workflow evidence --batch runs/batch_<UTC>_cuda/index.json --out log-entry.md
    replaykit-workflow evidence runs/<UTC>_<device>_torch<version>_<commit>

Prints ``| Tree | Runtime | Result |``, the failures per test id, links to the executed
notebooks (relative to --out's folder, else to the current one) and warnings. Every
executed notebook is checked against the sha256 in its summary.json. Exit code: 0 ok,
1 a notebook was edited after its run (or is missing), 2 bad arguments.
"""


def evidence_parser() -> argparse.ArgumentParser:
    ap = _parser("evidence", EVIDENCE_DOC)
    ap.add_argument(
        "folders",
        nargs="*",
        type=Path,
        help="run folders, downloaded .ipynb files, folders of them",
    )
    ap.add_argument(
        "--runs",
        action="append",
        type=Path,
        default=[],
        help="a folder of runs, batch folders included (default: runs/ when nothing is given)",
    )
    ap.add_argument(
        "--batch",
        action="append",
        type=Path,
        default=[],
        help="a batch (or bisect/arms) index.json or its folder",
    )
    ap.add_argument("--out", type=Path, help="also write the Markdown to this file")
    return ap


def _check_evidence(args: argparse.Namespace) -> None:
    """Every argument exists; a notebook given by name ran (one that never did is no evidence)."""
    inputs.needs("evidence", "nbformat")
    for path in [*args.folders, *args.runs, *args.batch]:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or folder")
    for path in args.folders:
        if path.suffix == ".ipynb" and path.is_file():
            inputs.executed_notebook(path)


def evidence(argv: list[str] | None = None) -> int:
    args = evidence_parser().parse_args(argv)
    runs = args.runs or ([] if args.batch or args.folders else [Path("runs")])
    try:
        _check_evidence(args)
        from replaykit.workflow.evidence import collect

        ev = collect(runs=runs, batches=args.batch, folders=args.folders)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ev.runs:
        skipped = f" ({len(ev.skipped)} folder(s) without a notebook summary)" if ev.skipped else ""
        print(f"error: no notebook runs found{skipped}", file=sys.stderr)
        return 2
    text = ev.markdown(relative_to=args.out.parent if args.out else None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    if ev.skipped:
        print(f"skipped {len(ev.skipped)} folder(s) without a notebook summary", file=sys.stderr)
    if ev.edited:
        print(f"{len(ev.edited)} notebook(s) edited after the run or missing", file=sys.stderr)
        return 1
    return 0


# --- bisect ------------------------------------------------------------------


BISECT_DOC = """Find the first commit that fails a test selection; or run it on several trees side by side.

    replaykit-workflow bisect --good <good> --bad <bad> -m cuda
    replaykit-workflow bisect --good v1 --bad HEAD -m "" --id tests/core/test_hold.py -- -x
    replaykit-workflow bisect --arm baseline=main --arm candidate=HEAD --arm diagnostic=../diag -m cuda

Each commit is packed and run through the workflow's verify notebook; runs and an index.json
go to runs/bisect_<UTC>_… (or runs/arms_<UTC>_…). A commit whose run errs (kernel died,
collection error) is skipped, as with `git bisect skip`. Exit code: bisect 0 when the first
bad commit is known, 1 when skipped commits leave it open; arms 0; 2 bad arguments.
"""


def bisect_parser() -> argparse.ArgumentParser:
    ap = _parser("bisect", BISECT_DOC)
    ap.add_argument("--good", help="a revision where the selection passes")
    ap.add_argument("--bad", help="a later revision where it fails")
    ap.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="LABEL=TREE",
        help="instead of bisecting: run on this tree (revision, folder or archive); repeatable",
    )
    ap.add_argument(
        "--timeout", type=float, default=0, help="seconds before one pytest run is killed"
    )
    ap.add_argument("--repo", type=Path, default=Path("."), help="repository (default: here)")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"))
    ap.add_argument("--kernel", help="kernelspec name (default: this interpreter)")
    _selection_options(ap)
    return ap


def _arms(items: list[str]) -> dict[str, str]:
    trees: dict[str, str] = {}
    for item in items:
        label, sep, tree = item.partition("=")
        if not sep or not label or not tree:
            raise ValueError(f"--arm {item!r}: expected LABEL=TREE")
        if label in trees:
            raise ValueError(f"--arm label {label!r} given twice")
        trees[label] = tree
    return trees


def bisect(argv: list[str] | None = None) -> int:
    args = bisect_parser().parse_args(argv)
    try:
        inputs.needs("bisect", "papermill", "nbclient", "nbformat", "pytest")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from replaykit.workflow import bisect as bs

    common = {
        "markers": args.markers or None,
        "ids": args.ids,
        "runs_dir": args.runs_dir,
        "kernel": args.kernel,
        "progress": not args.no_progress,
        "repeats": args.repeats,
        "extra_args": args.extra,
        "run_timeout": args.timeout,
    }
    try:
        if args.arm:
            if args.good or args.bad:
                raise ValueError("give --arm, or --good and --bad, not both")
            result = bs.arms(_arms(args.arm), repo=args.repo, **common)
            print(result.folder)
            print(result.markdown())
            return 0
        if not (args.good and args.bad):
            raise ValueError("give --good and --bad (or --arm LABEL=TREE ...)")
        found = bs.bisect(args.repo, args.good, args.bad, **common)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(found.folder)
    print(found.report(), end="")
    return 0 if found.first_bad is not None else 1


# --- the dispatcher ----------------------------------------------------------


def pack(argv: list[str] | None = None) -> int:
    return archive.main(argv, prog=f"{PROG} pack")


COMMANDS: dict[str, Callable[[list[str] | None], int]] = {
    "pack": pack,
    "run": run,
    "batch": batch,
    "verify": verify,
    "evidence": evidence,
    "bisect": bisect,
}


def main(argv: list[str] | None = None) -> int:
    """``replaykit-workflow COMMAND [options]``; ``COMMAND --help`` for its options."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} {{{','.join(COMMANDS)}}} ...\n\n{__doc__}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: unknown command {command!r}; one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except KeyboardInterrupt:  # what was saved is saved; no traceback of the threads it stopped
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:  # an extra that is not installed (a core install)
        print(f"{PROG} {command}: needs {exc.name}: {inputs.INSTALL_HINT}", file=sys.stderr)
        return 2
