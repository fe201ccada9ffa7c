# One module: the runs of a selection and the verdict tables read from their junit XML belong together.
"""Run a pytest selection against a source tree and turn its junit XML into tables.

``resolve_tree`` turns the current checkout, a directory or an uploaded archive (made by
``replaykit-workflow pack``) into a directory, checking the archive and its manifest before
anything runs (``archive.open_tree``). ``run_selection`` runs pytest there ``repeats`` times,
then each failing id alone, and returns a ``Selection`` whose tables say per test id whether a failure is
stable, flaky, or appears only when other tests run first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replaykit.workflow.archive import check_manifest, open_tree
from replaykit.workflow.fingerprint import default_tree

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "NO_TESTS_RAN",
    "VERDICTS",
    "CaseResult",
    "Run",
    "Selection",
    "check_manifest",
    "node_id",
    "pytest_summary_line",
    "read_junit",
    "resolve_tree",
    "run_selection",
]

STATUSES = ("passed", "failed", "error", "skipped")
NO_TESTS_COLLECTED = 5
"""pytest's exit code when nothing was collected: recorded, not an error."""

NO_TESTS_RAN = "no tests ran"
"""The outcome of a selection that executed no test (all skipped or deselected): never a pass."""

VERDICTS = ("stable pass", "stable fail", "flaky", "fails only with others", "skipped")
_FAILING = ("failed", "error")
_SUMMARY = re.compile(
    r"(\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)|no tests ran)\b.*"
    r"\bin \d+(\.\d+)?s\b"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# --- the tree ---------------------------------------------------------------


def resolve_tree(tree: str | Path | None, workdir: Path) -> Path:
    """The directory whose tests to run, checked against its manifest.

    ``None``/``""``: the checkout that holds this replaykit package. A directory: itself
    (it must hold ``tests/`` or ``pyproject.toml``). A ``.tar.gz``/``.tgz``/``.tar``: extracted
    safely into ``workdir``. A manifest is verified. See ``archive.open_tree``, which does it.
    """
    if tree is None or str(tree) == "":
        tree = default_tree()
    return open_tree(tree, Path(workdir))


# --- junit XML --------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    """One test case of one pytest run."""

    id: str  # pytest node id, e.g. tests/test_x.py::TestA::test_b[1]
    classname: str  # as junit wrote it, e.g. tests.test_x.TestA
    name: str
    status: str  # passed | failed | error | skipped
    message: str  # first line of the failure/error (skip reason for skips), "" when passed
    time: float


def node_id(classname: str, name: str, tree: Path | None = None) -> str:
    """pytest's node id from junit's ``classname`` and ``name`` (best effort).

    junit dots the file path (``tests/test_x.py`` -> ``tests.test_x``) and appends class
    names; the module is the longest dotted prefix that is a file in ``tree``, else the
    parts before the first capitalised one. A collection entry (empty classname) names
    the module itself.
    """
    parts = classname.split(".") if classname else name.split(".")
    tail = [name] if classname else []
    split = None
    if tree is not None:
        split = next(
            (
                k
                for k in range(len(parts), 0, -1)
                if (tree / ("/".join(parts[:k]) + ".py")).is_file()
            ),
            None,
        )
    if split is None:
        split = next((k for k in range(1, len(parts)) if parts[k][:1].isupper()), len(parts))
    return "::".join(["/".join(parts[:split]) + ".py", *parts[split:], *tail])


def _first_line(result: Any) -> str:
    message = (result.message or "").strip()
    if (
        message and message != "collection failure"
    ):  # pytest's word for any collection error: the text says which
        return message.splitlines()[0].strip()
    lines = (result.text or "").splitlines()
    for line in lines:
        if line.startswith("E "):
            return line[1:].strip()
    return next((line.strip() for line in lines if line.strip()), "")


def _case(case: Any, tree: Path | None) -> CaseResult:
    from junitparser import Error, Failure

    results = case.result
    failure = next((r for r in results if isinstance(r, Failure)), None)
    error = next((r for r in results if isinstance(r, Error)), None)
    if failure is not None:
        status, first = "failed", failure
    elif error is not None:
        status, first = "error", error
    elif case.is_skipped:
        status, first = "skipped", results[0]
    else:
        status, first = "passed", None
    classname, name = case.classname or "", case.name or ""
    return CaseResult(
        id=node_id(classname, name, tree),
        classname=classname,
        name=name,
        status=status,
        message=_first_line(first) if first is not None else "",
        time=float(case.time or 0.0),
    )


def read_junit(path: Path, tree: Path | None = None) -> list[CaseResult]:
    """The test cases of one junit XML file written by pytest."""
    from junitparser import JUnitXml, TestSuite

    xml = JUnitXml.fromfile(str(path))
    suites = [xml] if isinstance(xml, TestSuite) else list(xml)
    return [_case(case, tree) for suite in suites for case in suite]


# --- runs -------------------------------------------------------------------


def pytest_summary_line(log_text: str) -> str:
    """The last pytest summary line (``3 passed, 1 failed in 0.5s``), "" when there is none."""
    found = ""
    for line in _ANSI.sub("", log_text).splitlines():
        if _SUMMARY.search(line):
            found = line.strip().strip("=").strip()
    return found


@dataclass
class Run:
    """One pytest process: a repeat of the whole selection, or one failing id alone."""

    kind: str  # "repeat" | "alone"
    index: int  # 1-based within its kind
    test_id: str | None  # the id run alone; None for repeats
    returncode: int | None  # None: killed at the timeout
    summary: str  # pytest's summary line
    junit: Path
    log: Path
    seconds: float
    cases: list[CaseResult] = field(default_factory=list)
    error: str | None = None  # timeout, missing or unreadable junit XML
    _statuses: dict[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def label(self) -> str:
        """``r1``, ``r2``, … for repeats; ``alone`` for isolated runs."""
        return f"r{self.index}" if self.kind == "repeat" else "alone"

    def statuses(self) -> dict[str, str]:
        """Status per test id (a duplicated id keeps its worst status)."""
        if self._statuses is None:
            rank = {"failed": 3, "error": 2, "passed": 1, "skipped": 0}
            out: dict[str, str] = {}
            for case in self.cases:
                if case.id not in out or rank[case.status] > rank[out[case.id]]:
                    out[case.id] = case.status
            self._statuses = out
        return self._statuses

    def record(self) -> dict[str, Any]:
        """JSON-able record (file names relative to the output folder)."""
        return {
            "kind": self.kind,
            "index": self.index,
            "test_id": self.test_id,
            "returncode": self.returncode,
            "summary": self.summary,
            "junit": self.junit.name,
            "log": self.log.name,
            "seconds": round(self.seconds, 3),
            "error": self.error,
        }


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    if env.get("MPLBACKEND", "").startswith("module://"):  # a notebook kernel's inline backend
        env["MPLBACKEND"] = "Agg"
    return env


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    proc.wait()


def _run_pytest(
    base: list[str],
    args: list[str],
    *,
    kind: str,
    index: int,
    test_id: str | None,
    tree: Path,
    out_dir: Path,
    timeout: float | None,
) -> Run:
    stem = f"r{index}" if kind == "repeat" else f"alone_{index}"
    junit, log = out_dir / f"junit_{stem}.xml", out_dir / f"pytest_{stem}.log"
    junit.unlink(missing_ok=True)
    cmd = [*base, f"--junitxml={junit}", *args]
    error = None
    t0 = time.monotonic()
    with log.open("w") as fh:
        fh.write(f"$ cd {shlex.quote(str(tree))} && {shlex.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=tree,
            env=_env(tree),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=hasattr(os, "killpg"),
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            returncode, error = None, f"timed out after {timeout} s"
        except BaseException:
            _kill(proc)
            raise
    seconds = time.monotonic() - t0
    cases: list[CaseResult] = []
    if junit.is_file():
        try:
            cases = read_junit(junit, tree)
        except Exception as exc:  # a half-written file from a killed run
            error = error or f"unreadable junit XML: {exc}"
    elif error is None:
        error = f"no junit XML (pytest exit {returncode})"
    summary = pytest_summary_line(log.read_text(errors="replace"))
    return Run(
        kind=kind,
        index=index,
        test_id=test_id,
        returncode=returncode,
        summary=summary,
        junit=junit,
        log=log,
        seconds=seconds,
        cases=cases,
        error=error,
    )


def run_selection(
    tree: Path,
    *,
    markers: str | None = "cuda",
    ids: list[str] | None = None,
    repeats: int = 1,
    isolate_failures: bool = True,
    extra_args: list[str] | None = None,
    out_dir: Path,
    timeout: float | None = None,
    python: str = sys.executable,
    progress: bool = True,
) -> Selection:
    """Run ``pytest [-m markers] [ids] [extra_args]`` in ``tree`` ``repeats`` times, then each failing id alone.

    Each run is a fresh ``python -m pytest`` with ``tree`` first on ``PYTHONPATH`` (its own
    package, not an installed one); its junit XML and log go to ``out_dir``. ``timeout``
    (seconds) kills one run. Exit code 5 (nothing collected) is recorded, not raised.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    from tqdm import tqdm

    tree, out_dir = Path(tree).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--color=no",
        f"--rootdir={tree}",
    ]
    select = ["-m", markers] if markers else []
    extra = list(extra_args or [])
    common = {"tree": tree, "out_dir": out_dir, "timeout": timeout}
    runs: list[Run] = []
    with tqdm(total=repeats, desc="pytest", unit="run", disable=not progress) as bar:
        for k in range(1, repeats + 1):
            bar.set_postfix_str(f"r{k}")
            runs.append(
                _run_pytest(
                    base,
                    [*select, *(ids or []), *extra],
                    kind="repeat",
                    index=k,
                    test_id=None,
                    **common,
                )
            )
            bar.update()
        failing = _failing(runs) if isolate_failures else []
        bar.total = repeats + len(failing)
        for n, test_id in enumerate(failing, 1):
            bar.set_postfix_str(f"alone {n}/{len(failing)}")
            runs.append(
                _run_pytest(
                    base,
                    [*select, test_id, *extra],
                    kind="alone",
                    index=n,
                    test_id=test_id,
                    **common,
                )
            )
            bar.update()
    return Selection(tree=tree, command=[*base, *select, *(ids or []), *extra], runs=runs)


def _failing(runs: list[Run]) -> list[str]:
    """Ids that failed or errored in any of ``runs``, first seen first."""
    out: dict[str, None] = {}
    for run in runs:
        out |= {i: None for i, s in run.statuses().items() if s in _FAILING}
    return list(out)


# --- the selection ----------------------------------------------------------


@dataclass
class Selection:
    """The runs of one selection and the tables made from them."""

    tree: Path
    command: list[str]  # the pytest command of a repeat (without --junitxml)
    runs: list[Run]

    @property
    def repeats(self) -> list[Run]:
        return [r for r in self.runs if r.kind == "repeat"]

    @property
    def alone(self) -> list[Run]:
        return [r for r in self.runs if r.kind == "alone"]

    def ids(self) -> list[str]:
        """Test ids seen in the repeats, first seen first."""
        out: dict[str, None] = {}
        for run in self.repeats:
            out |= dict.fromkeys(run.statuses())
        return list(out)

    def alone_status(self, test_id: str) -> str:
        """Result of ``test_id`` run alone ("" when it was not run alone)."""
        for run in self.alone:
            if run.test_id != test_id:
                continue
            statuses = run.statuses()
            if test_id in statuses:
                return statuses[test_id]
            found = set(statuses.values())  # e.g. a module id that expands to its tests
            return next(
                (s for s in ("failed", "error", "passed", "skipped") if s in found), "error"
            )
        return ""

    def verdict(self, test_id: str) -> str:
        """One of ``VERDICTS`` from the repeats and the alone run."""
        seen = [r.statuses().get(test_id) for r in self.repeats]
        seen = [s for s in seen if s]
        if any(s in _FAILING for s in seen):
            if "passed" in seen:
                return "flaky"
            if self.alone_status(test_id) == "passed":
                return "fails only with others"
            return "stable fail"
        return "stable pass" if "passed" in seen else "skipped"

    def table(self) -> pd.DataFrame:
        """One row per test id: ``id``, ``r1``…``rN``, ``alone``, ``stable``."""
        import pandas as pd

        labels = [r.label for r in self.repeats]
        per_run = [r.statuses() for r in self.repeats]
        rows = [
            {
                "id": i,
                **{lab: st.get(i, "") for lab, st in zip(labels, per_run, strict=True)},
                "alone": self.alone_status(i),
                "stable": self.verdict(i),
            }
            for i in self.ids()
        ]
        return pd.DataFrame(rows, columns=["id", *labels, "alone", "stable"])

    def failures(self) -> pd.DataFrame:
        """Every failed or errored case: ``id``, ``repeat`` (r1… or alone), ``status``, ``message``, ``time``."""
        import pandas as pd

        rows = [
            {
                "id": c.id,
                "repeat": run.label,
                "status": c.status,
                "message": c.message,
                "time": c.time,
            }
            for run in self.runs
            for c in run.cases
            if c.status in _FAILING
        ]
        return pd.DataFrame(rows, columns=["id", "repeat", "status", "message", "time"])

    def counts(self) -> dict[str, dict[str, int]]:
        """passed/failed/error/skipped per repeat (``r1``…), of the alone runs, and ``total`` over repeats."""
        out: dict[str, dict[str, int]] = {}
        total = dict.fromkeys(STATUSES, 0)
        for run in self.repeats:
            tally = dict.fromkeys(STATUSES, 0)
            for status in run.statuses().values():
                tally[status] += 1
                total[status] += 1
            out[run.label] = tally
        if self.alone:
            alone = dict.fromkeys(STATUSES, 0)
            for run in self.alone:
                status = self.alone_status(run.test_id or "")
                if status:
                    alone[status] += 1
            out["alone"] = alone
        out["total"] = total
        return out

    def failing_ids(self) -> list[str]:
        """Ids that failed or errored in any repeat."""
        return _failing(self.repeats)

    def flaky_ids(self) -> list[str]:
        return [i for i in self.ids() if self.verdict(i) == "flaky"]

    def run_errors(self) -> list[str]:
        """Runs that did not end normally: timeouts, missing junit, pytest exit codes other than 0/1/5."""
        out = []
        for run in self.runs:
            where = run.label + (f" {run.test_id}" if run.test_id else "")
            if run.error:
                out.append(f"{where}: {run.error}")
            elif run.returncode not in (0, 1, NO_TESTS_COLLECTED):
                out.append(
                    f"{where}: pytest exit {run.returncode} ({run.summary or 'see ' + run.log.name})"
                )
        return out

    def executed(self) -> int:
        """Test ids that ran (passed, failed or errored) in any repeat; skips do not count."""
        return sum(
            any(r.statuses().get(i, "skipped") != "skipped" for r in self.repeats)
            for i in self.ids()
        )

    def outcome(self) -> str:
        """``failed``, ``run error``, ``no tests ran`` (nothing executed: a pass nobody earned) or ``passed``."""
        if self.failing_ids():
            return "failed"
        if self.run_errors():
            return "run error"
        return "passed" if self.executed() else NO_TESTS_RAN

    @property
    def ok(self) -> bool:
        """True when some selected test ran, none failed in any repeat, and every run ended normally."""
        return self.outcome() == "passed"

    def outcome_line(self) -> str:
        """One line for a person: the outcome, and why when nothing ran."""
        text = self.outcome()
        if text == NO_TESTS_RAN:
            skipped = len(self.ids())
            text += (
                f": {skipped} selected, all skipped" if skipped else ": nothing selected"
            ) + " (on a CPU, a `cuda` selection runs nothing: choose -m 'not cuda')"
        return text

    def summary_lines(self) -> list[str]:
        """One line per run: label, pytest's summary line, exit code."""
        lines = []
        for run in self.runs:
            where = run.label + (f" {run.test_id}" if run.test_id else "")
            what = run.summary or run.error or "no summary line"
            rc = "timeout" if run.returncode is None else f"exit {run.returncode}"
            lines.append(f"{where}: {what} ({rc}, {run.seconds:.1f} s)")
        return lines

    def results(self) -> dict[str, Any]:
        """JSON-able results for ``replaykit.runs.write_results`` (``counts`` = totals over repeats)."""
        counts = self.counts()
        return {
            "counts": counts["total"],
            "counts_per_run": {k: v for k, v in counts.items() if k != "total"},
            "ok": self.ok,
            "outcome": self.outcome(),
            "tests": len(self.ids()),
            "executed": self.executed(),
            "repeats": len(self.repeats),
            "summary_lines": self.summary_lines(),
            "pytest_summary": [r.summary for r in self.repeats],
            "failing_ids": self.failing_ids(),
            "flaky_ids": self.flaky_ids(),
            "verdicts": {i: self.verdict(i) for i in self.ids()},
            "run_errors": self.run_errors(),
            "command": shlex.join(self.command),
            "tree": str(self.tree),
            "runs": [r.record() for r in self.runs],
        }
