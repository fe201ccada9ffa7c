"""The runner's outcomes for people: a table, one word per outcome, flat rows for a DataFrame,
and the summary with the replay coverage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .catalogue import KNOWN_LIMITS
from .outcome import BOTH_RAISE, REPLAYED, Outcome


def table(outcomes: Sequence[Outcome], markdown: bool = True) -> str:
    """The outcomes as a markdown (or plain text) table, failures flagged."""
    header = ["hazard", "pattern", "api", "backend", "guard", "outcome", "journal"]
    rows = []
    for o in outcomes:
        flag = "FAIL " if o.failed else ""
        j = o.journal
        summary = (
            f"rec {j.get('record', 0)} rep {j.get('replay', 0)} eager {j.get('eager', 0)}"
            if j
            else ""
        )
        arm = " (unsafe)" if o.unsafe else ""
        rows.append(
            [o.hazard, o.pattern + arm, o.api, o.backend, o.guard or "-", flag + o.line(), summary]
        )
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]
        ]
    failed = sum(o.failed for o in outcomes)
    lines.append("")
    lines.append(f"{len(outcomes)} outcomes, {failed} failures")
    return "\n".join(lines)


def verdict(o: Outcome) -> str:
    """One word per outcome for a pattern x backend grid: replayed, eager, retired, error, or FAIL."""
    if o.failed:
        return "FAIL"
    if o.unsafe and not o.diverged:
        return "not shown here"
    return {
        "replayed bitwise": "replayed",
        "routed eager": "eager",
        "retired": "retired",
        "clear error": "error",
        "both raise": "both raise",
    }.get(o.kind, "diverged" if o.unsafe else o.kind)


def rows(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One flat row per outcome, for a DataFrame or CSV."""
    return [
        {
            "hazard": o.hazard,
            "pattern": o.pattern,
            "api": o.api,
            "backend": o.backend,
            "arm": "unsafe" if o.unsafe else "guarded",
            "guard": o.guard or "-",
            "verdict": verdict(o),
            "outcome": o.line(),
            "failed": o.failed,
            "records": o.journal.get("record", 0),
            "replays": o.journal.get("replay", 0),
            "eager": o.journal.get("eager", 0),
            "seconds": round(o.seconds, 3),
        }
        for o in outcomes
    ]


def summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts for a run's summary.json, and the one line an engineering log quotes."""
    guarded = [o for o in outcomes if not o.unsafe]
    unsafe = [o for o in outcomes if o.unsafe]
    kinds: dict[str, int] = {}
    for o in guarded:
        kinds[verdict(o)] = kinds.get(verdict(o), 0) + 1
    backends = sorted({o.backend for o in outcomes})
    silent = sum(o.kind.startswith("SILENT") for o in guarded)
    line = (
        f"{len(guarded)} pattern runs on {', '.join(backends)}: {silent} silent differences, "
        f"{sum(o.failed for o in guarded)} failures ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"
    )
    if unsafe:
        line += f"; unsafe arms: {sum(o.diverged for o in unsafe)}/{len(unsafe)} diverged"
    covered = coverage(guarded)
    if covered:
        shares = ", ".join(
            f"{k} {c['replayed']}/{c['patterns']} ({c['share']:.0%})" for k, c in covered.items()
        )
        line += f"; replay coverage: {shares}"
    return {
        "line": line,
        "patterns": len({o.pattern for o in guarded}),
        "runs": len(guarded),
        "silent": silent,
        "failures": sum(o.failed for o in outcomes),
        "verdicts": kinds,
        "unsafe_runs": len(unsafe),
        "unsafe_diverged": sum(o.diverged for o in unsafe),
        "coverage": covered,
    }


def coverage(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """Replay coverage per ``"api/backend"``: of the realistic patterns run (guarded arms, not
    the known limits, nor those whose eager arm raises: ``both raise`` has nothing to replay),
    how many replayed bitwise; ``share`` is that fraction."""
    limits = {p.name for p in KNOWN_LIMITS}
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if not o.unsafe and o.pattern not in limits and o.kind != BOTH_RAISE:
            groups.setdefault(f"{o.api}/{o.backend}", []).append(o)
    out = {}
    for key, group in sorted(groups.items()):
        replayed = sum(o.kind == REPLAYED for o in group)
        out[key] = {"replayed": replayed, "patterns": len(group), "share": replayed / len(group)}
    return out
