"""Find the commit that broke a test selection; run one selection on several trees side by side.

    result = bisect(Path("."), "<good>", "<bad>", markers="cuda")   # runs/bisect_<UTC>_…/
    print(result.report())            # first bad commit + subject, every tested commit's verdict
    table = arms({"baseline": "main", "candidate": "HEAD", "diagnostic": "../diag"}, markers="cuda")
    print(table.markdown())           # test id × arm

Each tested commit is packed (``replaykit.pack``), unpacked, and run through this checkout's
``notebooks/verify.ipynb``, so old trees need not contain the notebook. A commit is bad when
any selected test fails, good when some selected test ran and none failed, and skipped
(untestable, as with ``git bisect skip``) when the run errs (the kernel died, pytest could not
collect, the notebook stopped before the tests ran) or when no test ran: a selection whose
every test skips on this device (``-m cuda`` on a CPU) proves nothing either way.

Both endpoints are run first, as ``git bisect`` insists: a ``good`` that is not good or a
``bad`` that is not bad raises ``EndpointError`` (the runs are kept), so no commit is ever
named that the search did not earn. The folder holds an ``index.json`` in the batch format,
so ``replaykit.evidence`` reads it.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from replaykit.workflow import tables
from replaykit.workflow.cells import error_cell, run_cell
from replaykit.workflow.errors import WorkflowError
from replaykit.workflow.fingerprint import notebook_path
from replaykit.workflow.git import GitError, git, git_text
from replaykit.workflow.index import new_folder, write_index
from replaykit.workflow.runs import kernel_executable
from replaykit.workflow.trees import PreparedTree, TreeSpec, prepare_tree
from replaykit.workflow.verdict import EXECUTED, result_text

__all__ = [
    "ArmsResult",
    "BisectResult",
    "Commit",
    "EndpointError",
    "arms",
    "bisect",
    "commits_between",
    "search",
    "verdict",
]

VERIFY_NOTEBOOK = notebook_path("verify.ipynb")
GOOD, BAD, SKIP = "good", "bad", "skip"
SHORT_VERDICTS = {
    "stable pass": "passed",
    "stable fail": "failed",
    "fails only with others": "fails with others",
}


class EndpointError(WorkflowError, ValueError):
    """``--good`` is not good or ``--bad`` is not bad on this device: bisecting would name a
    commit nobody tested. The endpoint runs are saved in ``folder``."""

    def __init__(self, message: str, folder: Path) -> None:
        super().__init__(f"{message} (runs: {folder})")
        self.folder = folder


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str

    @property
    def short(self) -> str:
        return self.sha[:7]


# --- git ---------------------------------------------------------------------


def _commit(repo: Path, rev: str) -> str:
    if rev.startswith("-"):
        raise ValueError(f"{rev!r} is not a revision")
    try:
        return git_text(repo, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}").strip()
    except GitError:
        raise ValueError(f"{rev!r} is not a commit in {repo}") from None


def commits_between(repo: Path, good: str, bad: str) -> list[Commit]:
    """Commits after ``good`` up to ``bad`` in first-parent order (``git rev-list --first-parent
    --reverse good..bad``), with subjects. ValueError when good is not an ancestor of bad."""
    repo = Path(repo)
    g, b = _commit(repo, good), _commit(repo, bad)
    try:
        git(repo, "merge-base", "--is-ancestor", g, b)
    except GitError:
        raise ValueError(
            f"good {good} ({g[:7]}) is not an ancestor of bad {bad} ({b[:7]})"
        ) from None
    shas = git_text(repo, "rev-list", "--first-parent", "--reverse", f"{g}..{b}").split()
    if not shas:
        raise ValueError(f"no commits between good {good} and bad {bad}")
    subjects = git_text(repo, "log", "--no-walk=unsorted", "--format=%H%x00%s", *shas).splitlines()
    by_sha = dict(line.split("\0", 1) for line in subjects if "\0" in line)
    return [Commit(sha, by_sha.get(sha, "")) for sha in shas]


# --- the search --------------------------------------------------------------


def search(n: int, test: Callable[[int], str]) -> list[int]:
    """Binary search over ``n`` ordered commits after a good one; the last (``n - 1``) is known
    bad (``bisect`` has run it) and is not tested again. ``test(i)`` returns good, bad or skip.

    Returns the candidates for the first bad commit: one index when it is known; several when
    skipped commits leave it open (the skipped ones in between, then the first known bad).
    """
    if n < 1:
        raise ValueError("nothing to search")
    lo, hi, skipped = -1, n - 1, set()
    while window := [i for i in range(lo + 1, hi) if i not in skipped]:
        middle = (lo + hi) / 2
        i = min(window, key=lambda k: (abs(k - middle), k))
        outcome = test(i)
        if outcome == GOOD:
            lo = i
        elif outcome == BAD:
            hi = i
        elif outcome == SKIP:
            skipped.add(i)
        else:
            raise ValueError(f"test returned {outcome!r}, expected good, bad or skip")
    return [i for i in range(lo + 1, hi) if i in skipped] + [hi]


def verdict(cell: dict[str, Any], summary: dict[str, Any] | None) -> tuple[str, str]:
    """(good | bad | skip, why) from a verify notebook run."""
    if cell["status"] == "error" or summary is None:
        return SKIP, cell["summary"]
    results = summary.get("results")
    if not isinstance(results, dict):
        return SKIP, f"no results: {cell['summary']}"  # stopped before the tests ran
    if results.get("run_errors"):
        return SKIP, "run error: " + "; ".join(results["run_errors"])[:300]
    if not results.get("tests"):
        return SKIP, "no tests selected"
    if results.get("failing_ids"):
        ids = results["failing_ids"]
        return BAD, f"{len(ids)} failing: " + ", ".join(ids[:5]) + (" …" if len(ids) > 5 else "")
    executed = results.get("executed")
    if executed is None:  # a summary from before ``executed`` was recorded
        counts = results.get("counts") or {}
        executed = sum(v for k, v in counts.items() if k in EXECUTED and isinstance(v, int))
    if not executed:  # every selected test skipped: this run says nothing about the commit
        return SKIP, result_text(summary)
    if cell["status"] == "passed":
        return GOOD, result_text(summary)
    return SKIP, cell["summary"]


# --- running the selection ---------------------------------------------------


@dataclass
class _Runner:
    """Runs the verify notebook on trees into one folder; keeps the index current."""

    folder: Path
    params: dict[str, Any]
    kernel: str | None
    notebook: Path
    doc: dict[str, Any]
    title: str

    def run(self, tree: PreparedTree) -> tuple[dict[str, Any], dict[str, Any] | None]:
        python = kernel_executable(self.kernel) if self.kernel else None
        cell = run_cell(
            self.notebook,
            self.params,
            tree,
            folder=self.folder,
            kernel=self.kernel,
            python=python,
            env=self.kernel or "current",
        )
        summary = None
        if cell.get("run_dir"):
            path = self.folder / cell["run_dir"] / "summary.json"
            summary = json.loads(path.read_text()) if path.is_file() else None
        return cell, summary

    def record(self, cell: dict[str, Any]) -> None:
        self.doc["cells"].append(cell)
        write_index(self.folder, self.doc, self.title)


def _parameters(
    markers: str | None,
    ids: list[str] | None,
    repeats: int,
    isolate_failures: bool,
    extra_args: list[str] | None,
    run_timeout: float,
) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return {
        "markers": markers or "",
        "ids": list(ids or []),
        "repeats": repeats,
        "isolate_failures": isolate_failures,
        "extra_args": list(extra_args or []),
        "run_timeout": run_timeout,
    }


def _check(notebook: Path, kernel: str | None) -> None:
    if not Path(notebook).is_file():
        raise FileNotFoundError(f"notebook not found: {notebook}")
    if kernel and kernel_executable(kernel) is None:
        raise ValueError(f"no kernelspec named {kernel!r} (see `jupyter kernelspec list`)")


# --- bisect ------------------------------------------------------------------


@dataclass
class Step:
    commit: Commit
    verdict: str
    why: str
    run_dir: str | None  # relative to the bisect folder


@dataclass
class BisectResult:
    """Every tested commit's verdict and the first bad commit (or the candidates left)."""

    good: str
    bad: str
    commits: list[Commit]
    steps: list[Step]
    candidates: list[Commit]
    folder: Path
    index: Path

    @property
    def first_bad(self) -> Commit | None:
        return self.candidates[0] if len(self.candidates) == 1 else None

    def verdicts(self) -> dict[str, str]:
        """short sha -> good | bad | skip for every tested commit."""
        return {s.commit.short: s.verdict for s in self.steps}

    refused: str | None = None  # why the endpoints did not hold (then no commit is named)

    def conclusion(self) -> str:
        if self.refused:
            return f"No verdict: {self.refused}"
        if self.first_bad is not None:
            c = self.first_bad
            return f"First bad commit: {c.short} {c.subject}"
        listed = ", ".join(f"{c.short} {c.subject}" for c in self.candidates)
        return f"Only skipped commits are left; the first bad commit is one of: {listed}"

    def report(self) -> str:
        """Markdown: the conclusion and a row per tested commit (``good`` first), in history order."""
        order = {c.sha: i for i, c in enumerate(self.commits)}
        order |= {s.commit.sha: -1 for s in self.steps if s.commit.sha not in order}  # the good end
        rows = [
            {
                "commit": s.commit.short,
                "subject": s.commit.subject,
                "verdict": s.verdict,
                "why": s.why,
                "run": s.run_dir or "",
            }
            for s in sorted(self.steps, key=lambda s: order[s.commit.sha])
        ]
        head = f"Bisect {self.good}..{self.bad}: {len(self.commits)} commits, {len(self.steps)} tested."
        return "\n".join(
            [
                head,
                "",
                self.conclusion(),
                "",
                tables.markdown(rows, ("commit", "subject", "verdict", "why", "run")),
                "",
            ]
        )


def bisect(
    repo: Path,
    good: str,
    bad: str,
    *,
    markers: str | None = "cuda",
    ids: list[str] | None = None,
    runs_dir: Path = Path("runs"),
    kernel: str | None = None,
    progress: bool = True,
    repeats: int = 1,
    isolate_failures: bool = False,
    extra_args: list[str] | None = None,
    run_timeout: float = 0,
    notebook: Path = VERIFY_NOTEBOOK,
) -> BisectResult:
    """Binary-search the commits after ``good`` up to ``bad`` for the first that fails the selection.

    ``good`` and then ``bad`` are run first; ``EndpointError`` (a ValueError) when ``good`` is not
    good or ``bad`` is not bad (a skip included: nothing ran, or the run erred). Runs go to
    ``runs_dir/bisect_<UTC>_<good>..<bad>/`` with ``index.json`` and ``bisect.md``, also when refused.
    ``kernel`` None runs this interpreter. Raises ValueError for bad revisions or arguments.
    """
    from tqdm import tqdm

    repo = Path(repo)
    _check(notebook, kernel)
    params = _parameters(markers, ids, repeats, isolate_failures, extra_args, run_timeout)
    commits = commits_between(repo, good, bad)
    good_sha = _commit(repo, good)
    good_commit = Commit(good_sha, git_text(repo, "log", "-1", "--format=%s", good_sha).strip())
    folder = new_folder(Path(runs_dir), "bisect", f"{good_sha[:7]}..{commits[-1].short}")
    doc: dict[str, Any] = {
        "kind": "bisect",
        "repo": str(repo.resolve()),
        "good": good,
        "bad": bad,
        "parameters": params,
        "commits": [asdict(c) for c in commits],
        "cells": [],
    }
    runner = _Runner(folder, params, kernel, Path(notebook), doc, f"Bisect {good}..{bad}")
    steps: list[Step] = []
    expected = 2 + math.ceil(math.log2(len(commits)))  # both endpoints, then the search
    with (
        tempfile.TemporaryDirectory(prefix="replaykit-bisect-") as tmp,
        tqdm(total=expected, desc="bisect", unit="commit", disable=not progress) as bar,
    ):

        def run(c: Commit) -> str:
            bar.set_postfix_str(c.short)
            try:
                tree = prepare_tree(TreeSpec(label=c.short, rev=c.sha), repo, Path(tmp) / c.short)
            except ValueError as exc:  # e.g. a symlink pack refuses: untestable, not fatal
                record = {
                    "env": "current",
                    "tree": {"label": c.short, "commit": c.sha, "short": c.short},
                    "notebook": str(notebook),
                    "parameters": params,
                }
                cell, summary = error_cell(record, "cannot pack", str(exc)), None
            else:
                cell, summary = runner.run(tree)
            outcome, why = verdict(cell, summary)
            steps.append(Step(c, outcome, why, cell.get("run_dir")))
            runner.record(cell | {"verdict": outcome, "why": why, "subject": c.subject})
            bar.total = max(bar.total, len(steps))
            bar.update()
            return outcome

        refused = _endpoints(run, good_commit, commits[-1])
        found = [] if refused else search(len(commits), lambda i: run(commits[i]))
    result = BisectResult(
        good=good,
        bad=bad,
        commits=commits,
        steps=steps,
        candidates=[commits[i] for i in found],
        folder=folder,
        index=folder / "index.json",
        refused=refused,
    )
    doc["result"] = {
        "candidates": [c.sha for c in result.candidates],
        "first_bad": result.first_bad.sha if result.first_bad else None,
        "refused": refused,
        "conclusion": result.conclusion(),
    }
    write_index(folder, doc, f"Bisect {good}..{bad}")
    (folder / "bisect.md").write_text(result.report())
    if refused:
        raise EndpointError(refused, folder)
    return result


def _endpoints(run: Callable[[Commit], str], good: Commit, bad: Commit) -> str | None:
    """Run ``good`` then ``bad``; why they cannot bracket a search, or None when they do."""
    hint = {
        SKIP: "untestable here: its run erred or ran no test (is the selection one this device "
        "runs? on a CPU, -m 'not cuda')"
    }
    outcome = run(good)
    if outcome != GOOD:
        what = hint.get(outcome, "it fails the selection; choose an older --good")
        return f"--good {good.short} {good.subject!r} is not good: {what}"
    outcome = run(bad)
    if outcome != BAD:
        what = hint.get(outcome, "it passes the selection; this range holds no bad commit")
        return f"--bad {bad.short} {bad.subject!r} is not bad: {what}"
    return None


# --- arms --------------------------------------------------------------------


@dataclass
class ArmsResult:
    """One verify run per arm; ``table()`` puts them side by side per test id."""

    labels: list[str]
    cells: list[dict[str, Any]]
    summaries: list[dict[str, Any] | None]
    folder: Path
    index: Path
    trees: list[dict[str, Any]] = field(default_factory=list)

    def table(self) -> list[dict[str, str]]:
        """Rows ``test`` + one column per arm (passed, failed, flaky, fails with others, skipped,
        ``-`` when the arm did not run it), then a ``result`` row with each arm's counts."""
        verdicts = []
        for summary in self.summaries:
            results = (summary or {}).get("results")
            verdicts.append(results.get("verdicts", {}) if isinstance(results, dict) else {})
        ids = list(dict.fromkeys(i for v in verdicts for i in v))
        rows = [
            {
                "test": i,
                **{
                    lab: SHORT_VERDICTS.get(v.get(i, "-"), v.get(i, "-"))
                    for lab, v in zip(self.labels, verdicts, strict=True)
                },
            }
            for i in ids
        ]
        result = {"test": "result"}
        for lab, cell, summary in zip(self.labels, self.cells, self.summaries, strict=True):
            result[lab] = result_text(summary) if summary else cell["summary"]
        return [*rows, result]

    def markdown(self) -> str:
        return tables.markdown(self.table(), ("test", *self.labels))


def _tree_spec(label: str, tree: str | Path) -> TreeSpec:
    if Path(tree).expanduser().exists():
        return TreeSpec(label=label, path=str(tree))
    return TreeSpec(label=label, rev=str(tree))


def arms(
    trees: dict[str, str | Path],
    *,
    repo: Path = Path("."),
    markers: str | None = "cuda",
    ids: list[str] | None = None,
    runs_dir: Path = Path("runs"),
    kernel: str | None = None,
    progress: bool = True,
    repeats: int = 1,
    isolate_failures: bool = True,
    extra_args: list[str] | None = None,
    run_timeout: float = 0,
    notebook: Path = VERIFY_NOTEBOOK,
) -> ArmsResult:
    """Run the same selection on each tree (``{label: folder, archive or revision}``), in order.

    Runs go to ``runs_dir/arms_<UTC>_<labels>/`` with ``index.json`` and ``arms.md``.
    """
    from tqdm import tqdm

    if not trees:
        raise ValueError("arms needs at least one tree")
    _check(notebook, kernel)
    params = _parameters(markers, ids, repeats, isolate_failures, extra_args, run_timeout)
    labels = list(trees)
    with tempfile.TemporaryDirectory(prefix="replaykit-arms-") as tmp:
        prepared = [prepare_tree(_tree_spec(lab, trees[lab]), repo, Path(tmp)) for lab in labels]
        folder = new_folder(Path(runs_dir), "arms", "-".join(labels))
        doc: dict[str, Any] = {
            "kind": "arms",
            "parameters": params,
            "trees": [t.record() for t in prepared],
            "cells": [],
        }
        runner = _Runner(folder, params, kernel, Path(notebook), doc, f"Arms: {', '.join(labels)}")
        cells, summaries = [], []
        for tree in tqdm(prepared, desc="arms", unit="arm", disable=not progress):
            cell, summary = runner.run(tree)
            runner.record(cell)
            cells.append(cell)
            summaries.append(summary)
    result = ArmsResult(
        labels=labels,
        cells=cells,
        summaries=summaries,
        folder=folder,
        index=folder / "index.json",
        trees=doc["trees"],
    )
    (folder / "arms.md").write_text(result.markdown() + "\n")
    return result
