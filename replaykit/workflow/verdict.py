"""What a run's verdict says, in words: counts, parts, the Result column, tree and runtime texts.

Shared by the seal (a notebook's last cell writes its result line) and the evidence (which reads
it back), so neither imports the other. The one rule: a row that did not run is never counted
as passed. A zoo row ``skipped: torchvision is not installed`` counts as skipped, and a run that
skipped any row reads ``passed, 2 skipped`` wherever its verdict is summarised, never a bare
``passed``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "EXECUTED",
    "ORDER",
    "SKIPPED_VERDICTS",
    "Part",
    "counts_text",
    "parts",
    "result_text",
    "runtime_text",
    "skipped",
    "status_text",
    "tree_text",
]

ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "error")
"""pytest's order in its summary line: ``18 failed, 9 passed, 1 skipped, 2 errors``."""
EXECUTED = ("failed", "passed", "error", "xfailed", "xpassed")
"""Counts of tests that ran; a run with none of them reads ``no tests ran``, whatever it skipped."""
SKIPPED_VERDICTS = ("skipped", "not run on cpu")
"""Zoo verdict kinds (the text before ``:``) of rows that never ran: a missing package, fp16 on a CPU."""


class Part(NamedTuple):
    """One part of a notebook's results: rows that passed, failed, and were skipped (never ran)."""

    name: str
    passed: int
    failed: int
    skipped: int = 0

    def text(self) -> str:
        """``zoo 2/2 +2 skipped``: passed of those that ran, then what did not run."""
        ran = f"{self.name} {self.passed}/{self.passed + self.failed}"
        return ran + (f" +{self.skipped} skipped" if self.skipped else "")


def tree_text(
    tree: dict[str, Any], label: str | None = None, intended: dict[str, Any] | None = None
) -> str:
    """``bb3c0b8 (candidate)``: short commit, ``-dirty`` when it was, the label when it says more."""
    intended = intended or {}
    commit = tree.get("commit") or intended.get("commit")
    dirty = tree.get("dirty") if tree.get("commit") else intended.get("dirty")
    if commit:
        text = str(commit)[:7] + ("-dirty" if dirty else "")
        if label and not str(commit).startswith(label) and label != text:
            text += f" ({label})"
        return text
    if label:
        return label
    path = tree.get("path")
    return Path(path).name if path else "(unknown tree)"


def runtime_text(fp: dict[str, Any]) -> str:
    """``Python 3.11 / torch 2.9.1+cu129``, plus `` / <GPU>`` when the run had one."""
    version = str(fp.get("python") or "?")
    out = [f"Python {'.'.join(version.split('.')[:2])}", f"torch {fp.get('torch') or 'none'}"]
    gpu = fp.get("gpu") or (
        fp.get("device") if fp.get("device") not in (None, "cpu", "unknown") else None
    )
    if gpu:
        out.append(str(gpu))
    return " / ".join(out)


def counts_text(counts: dict[str, Any]) -> str:
    """``18 failed, 9 passed`` in pytest's order; zeros left out; ``2 errors``; ``no tests ran (71 skipped)``."""
    items = [
        (k, v) for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool) and v
    ]
    rank = {k: i for i, k in enumerate(ORDER)}
    items.sort(key=lambda kv: rank.get(kv[0], len(ORDER)))
    words = [f"{v} {k + 's' if k == 'error' and v > 1 else k}" for k, v in items]
    if not any(counts.get(k) for k in EXECUTED):  # all skipped or deselected: nothing earned a pass
        return "no tests ran" + (f" ({', '.join(words)})" if words else "")
    return ", ".join(words)


def _n(value: Any) -> int:
    """A count given as a number or as the list of what it counts."""
    return len(value) if isinstance(value, list) else int(value or 0)


def _row_skipped(row: dict[str, Any]) -> bool:
    text = str(row.get("note") or row.get("status") or row.get("verdict") or "")
    return "skipped:" in text or text.startswith("not run on cpu")


def _equal_rows(rows: Any) -> tuple[int, int, int]:
    """(bitwise equal, not equal, skipped) over a benchmark's replaykit rows (arms ``replaykit…``)."""
    mine = [
        r
        for r in (rows if isinstance(rows, list) else [])
        if isinstance(r, dict) and str(r.get("arm", "")).startswith("replaykit")
    ]
    compared = [r for r in mine if r.get("equals_eager") is not None]
    equal = sum(bool(r["equals_eager"]) for r in compared)
    skipped = sum(r.get("equals_eager") is None and _row_skipped(r) for r in mine)
    return equal, len(compared) - equal, skipped


def _zoo_part(zoo: dict[str, Any]) -> Part:
    """The zoo's rows: a row whose verdict is ``skipped: ...`` or ``not run on cpu: ...`` never ran."""
    if not isinstance(zoo.get("rows"), int):
        return Part("zoo", *_equal_rows(zoo.get("rows")))
    kinds = zoo.get("verdicts") if isinstance(zoo.get("verdicts"), dict) else {}
    skipped = sum(_n(kinds.get(k)) for k in SKIPPED_VERDICTS)
    failed = _n(zoo.get("failed"))
    return Part("zoo", max(zoo["rows"] - failed - skipped, 0), failed, skipped)


def parts(results: dict[str, Any]) -> list[Part]:
    """Each part a notebook's results hold, as (name, passed, failed, skipped).

    parity: its Lightning ``scenarios``, ``zoo`` rows and ``whole step`` scenarios; hazards: its
    pattern runs (the unsafe arms included); benchmark: its replaykit rows bitwise equal to eager
    (sizes, zoo, whole step). The verify notebook has pytest's ``counts`` instead.
    """
    out: list[Part] = []
    if isinstance(results.get("scenarios"), int) and isinstance(results.get("passed"), int):
        out.append(Part("scenarios", results["passed"], _n(results.get("failed"))))
    if isinstance(results.get("runs"), int) and "failures" in results:  # hazards
        runs = results["runs"] + int(results.get("unsafe_runs") or 0)
        failed = _n(results["failures"])
        out.append(Part("pattern runs", runs - failed, failed))
    if "replaykit_equal" in results:  # benchmark
        out.append(Part("sizes", *_equal_rows(results.get("rows"))))
    zoo = results.get("zoo")
    if isinstance(zoo, dict):
        out.append(_zoo_part(zoo))
    step = results.get("whole_step")
    if isinstance(step, dict) and isinstance(step.get("total"), int):
        passed = int(step.get("passed") or 0)
        out.append(Part("whole step", passed, step["total"] - passed))
    elif isinstance(step, dict):
        out.append(Part("whole step", *_equal_rows(step.get("rows"))))
    return out


def _results(summary: dict[str, Any]) -> dict[str, Any]:
    results = summary.get("results")
    return results if isinstance(results, dict) else {}


def _counts(results: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any] | None:
    counts = results.get("counts") or summary.get("counts")
    if isinstance(counts, dict):
        return counts
    found = parts(results)
    if found:
        return {
            "failed": sum(p.failed for p in found),
            "passed": sum(p.passed for p in found),
            "skipped": sum(p.skipped for p in found),
        }
    return None


def skipped(summary: dict[str, Any]) -> int:
    """How many rows or tests of the run never ran (pytest's skipped, the zoo's skipped rows)."""
    counts = _counts(_results(summary), summary) or {}
    value = counts.get("skipped")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def status_text(summary: dict[str, Any]) -> str:
    """The status where a verdict is summarised: ``passed, 2 skipped`` is not a full pass."""
    status = str(summary.get("status"))
    n = skipped(summary)
    return f"{status}, {n} skipped" if status == "passed" and n else status


def _parts_text(results: dict[str, Any]) -> str:
    """`` (scenarios 4/4, zoo 2/2 +2 skipped, whole step 4/4)``: passed of those that ran, per part."""
    found = parts(results)
    if not found or isinstance(results.get("counts"), dict):
        return ""
    return " (" + ", ".join(p.text() for p in found) + ")"


def result_text(summary: dict[str, Any]) -> str:
    """The Result column: counts (per repeat when they differ), flaky ids, and how the run ended."""
    results = _results(summary)
    per_run = (
        results.get("counts_per_run") if isinstance(results.get("counts_per_run"), dict) else {}
    )
    repeats = {k: v for k, v in per_run.items() if re.fullmatch(r"r\d+", k) and isinstance(v, dict)}
    counts = _counts(results, summary)
    if len(repeats) > 1:
        texts = {k: counts_text(v) for k, v in repeats.items()}
        if len(set(texts.values())) == 1:
            text = f"{next(iter(texts.values()))} (×{len(texts)})"
        else:
            text = "; ".join(f"{k}: {t}" for k, t in texts.items())
    elif counts is not None:
        text = counts_text(counts) + _parts_text(results)
    else:
        text = str(results.get("line") or "")
    if results.get("flaky_ids"):
        text += f", {len(results['flaky_ids'])} flaky"
    status, reason = summary.get("status"), summary.get("reason")
    failing = counts is not None and any(counts.get(k) for k in ("failed", "error"))
    run_errors = results.get("run_errors")
    if run_errors:  # pytest did not end normally: a collection error, a timeout
        extra = f" (+{len(run_errors) - 1} more)" if len(run_errors) > 1 else ""
        return f"{text or status} (run error: {str(run_errors[0])[:160]}{extra})"
    if not text:
        return status if status == "passed" or not reason else f"{status} ({reason})"
    if text.startswith("no tests ran") and status == "failed":
        return text  # the notebook failed for exactly that reason
    if status == "error" or (status == "failed" and not failing):
        text += f" ({status}: {reason})" if reason else f" ({status})"
    return text
