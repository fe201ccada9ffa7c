"""The runner: each catalogue pattern eager vs replayed, classified per backend.

    python -m replaykit.testing.hazards --backend emulated [--unsafe] [--hazard inputs] [--json out.json]

prints the outcome table and exits 1 when any outcome is a failure (a silent
difference, an eager error the replay swallowed, or a replay error that is not a
``ReplayError``). With ``--unsafe`` it runs each guarded pattern with its guard
switched off instead; there a failure is an unsafe arm that did NOT diverge.

Outcomes, per pattern and backend (the replay arm against the eager arm):

- ``replayed bitwise``: end states equal bit for bit, the journal has a replay;
- ``routed eager``: equal, nothing replayed, the journal's eager reasons;
- ``retired``: equal, the recorder retired, with its reason;
- ``clear error``: the replay raised ``ReplayError``, eager did not;
- ``both raise``: eager raised and so did the replay;
- failures: ``SILENT DIFF`` (the first differing tensor, max abs difference, max ULP
  distance), ``eager raised, replay did not``, ``unclear error`` (the replay raised
  something other than ``ReplayError`` that eager did not).

Imports only torch and the public core API (``import replaykit as rk``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import replaykit as rk
from replaykit import bitwise

from .catalogue import HAZARDS, PATTERNS
from .pattern import Arm, Extras, Pattern

REPLAYED = "replayed bitwise"
ROUTED = "routed eager"
RETIRED = "retired"
CLEAR_ERROR = "clear error"
BOTH_RAISE = "both raise"
SILENT_DIFF = "SILENT DIFF"
EAGER_ONLY_RAISED = "eager raised, replay did not"
UNCLEAR_ERROR = "unclear error"
FAILURES = (SILENT_DIFF, EAGER_ONLY_RAISED, UNCLEAR_ERROR)

State = dict[str, "torch.Tensor | None"]


# --------------------------------------------------------------------------- bitwise comparison
@dataclass(frozen=True)
class Diff:
    """One tensor that differs: ``problem`` is missing, none, dtype, shape, device or values."""

    name: str
    problem: str
    max_abs: float | None = None
    ulp: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        if self.problem != "values":
            return f"{self.name}: {self.problem} {self.detail}".rstrip()
        ulp = "" if self.ulp is None else f", {self.ulp} ulp"
        return f"{self.name}: max abs {self.max_abs:.3g}{ulp}"


def compare_states(expected: State, actual: State) -> list[Diff]:
    """Every tensor of ``actual`` that differs bitwise from ``expected`` (``replaykit.bitwise``), in ``expected``'s order."""
    diffs: list[Diff] = []
    for name in [*expected, *(n for n in actual if n not in expected)]:
        if name not in expected or name not in actual:
            diffs.append(Diff(name, "missing", detail="in eager" if name not in expected else "in replay"))
            continue
        a, b = expected[name], actual[name]
        if a is not None and b is not None:
            if a.layout != torch.strided or b.layout != torch.strided:
                a, b = a.to_dense(), b.to_dense()
            if a.device != b.device:
                diffs.append(Diff(name, "device", detail=f"{a.device} vs {b.device}"))
                continue
        row = bitwise.diff(name, a, b)
        if row is None:
            continue
        if row.problem == "none_pattern":
            diffs.append(Diff(name, "none", detail=f"eager {_what(a)}, replay {_what(b)}"))
        elif row.problem != "values":
            detail = f"{a.dtype} vs {b.dtype}" if row.problem == "dtype" else f"{tuple(a.shape)} vs {tuple(b.shape)}"
            diffs.append(Diff(name, row.problem, detail=detail))
        else:
            ulp = row.max_ulp if a.is_floating_point() else None
            max_abs = 0.0 if row.max_abs != row.max_abs else row.max_abs  # NaN-only differences
            diffs.append(Diff(name, "values", max_abs, ulp))
    return diffs


def _what(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"tensor{tuple(t.shape)}"


def end_state(model: nn.Module, extras: Extras) -> State:
    """Parameters, their ``.grad``, buffers and the pattern's extras, detached copies."""
    state: State = {}
    for name, p in model.named_parameters():
        state[f"param/{name}"] = p.detach().clone()
        state[f"grad/{name}"] = None if p.grad is None else p.grad.detach().clone()
    for name, b in model.named_buffers():
        state[f"buffer/{name}"] = b.detach().clone()
    for name, t in extras.items():
        state[f"out/{name}"] = None if t is None else t.detach().clone()
    return state


# --------------------------------------------------------------------------- running one pattern
@dataclass
class ArmResult:
    state: State | None
    error: BaseException | None
    journal: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """One pattern on one backend: the classification and what it rests on."""

    pattern: str
    hazard: str
    backend: str
    kind: str
    detail: str = ""
    unsafe: bool = False
    guard: str | None = None
    journal: dict[str, Any] = field(default_factory=dict)
    diffs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kernel_dependent: bool = False

    @property
    def failed(self) -> bool:
        """A failure of the contract; for an unsafe arm, a run that did not diverge (unless that depends on the machine)."""
        if self.unsafe:
            return not self.diverged and not self.kernel_dependent
        return self.kind in FAILURES

    @property
    def diverged(self) -> bool:
        """The contract broke: a silent difference, a swallowed eager error or an unclear error.

        For an unsafe arm that is the proof its guard is needed (a data-dependent shape
        without its guard fails loudly on the emulated backend, silently on CUDA).
        """
        return self.kind in FAILURES

    def line(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def _device_of(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _run_arm(pat: Pattern, device: str, backend: str | None, disable: tuple[str, ...], name: str) -> ArmResult:
    torch.manual_seed(0)
    model = pat.make(device)
    rec = None
    result = ArmResult(None, None)
    try:
        if backend is not None:
            target = pat.target(model) if pat.target is not None else model
            rec = rk.capture(target, backend=backend, unsafe_disable=disable)
        torch.manual_seed(1)
        extras = pat.train(model, Arm(device, name, rec))
        result.state = end_state(model, extras)
    except Exception as exc:  # the outcome classifies it
        result.error = exc
    finally:
        if rec is not None:
            result.journal = _journal(rec)
            try:
                rec.release()
            except Exception as exc:  # a release that fails is a finding too
                result.journal["release_error"] = f"{type(exc).__name__}: {exc}"
    return result


def _journal(rec: Any) -> dict[str, Any]:
    return {
        **rec.counts,
        "eager_reasons": dict(rec.eager_reasons),
        "retired": bool(rec.retired),
        "retire_reason": rec.retire_reason,
    }


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:200]


def classify(eager: ArmResult, replay: ArmResult) -> tuple[str, str, list[str]]:
    """(kind, detail, diff lines) of a replay arm against its eager arm."""
    if eager.error is not None:
        if replay.error is not None:
            return BOTH_RAISE, f"eager {_error(eager.error)}; replay {_error(replay.error)}", []
        return EAGER_ONLY_RAISED, f"eager {_error(eager.error)}", []
    if replay.error is not None:
        kind = CLEAR_ERROR if isinstance(replay.error, rk.ReplayError) else UNCLEAR_ERROR
        return kind, _error(replay.error), []
    assert eager.state is not None and replay.state is not None
    diffs = compare_states(eager.state, replay.state)
    if diffs:
        more = f" (+{len(diffs) - 1} more)" if len(diffs) > 1 else ""
        return SILENT_DIFF, f"{diffs[0]}{more}", [str(d) for d in diffs]
    journal = replay.journal
    if journal.get("retired") and journal.get("retire_reason") != "released":
        return RETIRED, str(journal.get("retire_reason")), []
    if journal.get("replay", 0) >= 1:
        reasons = journal.get("eager_reasons") or {}
        return REPLAYED, f"also eager: {_reasons(reasons)}" if reasons else "", []
    return ROUTED, _reasons(journal.get("eager_reasons") or {}), []


def _reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items())) or "no eager reason journaled"


def run_pattern(pattern: Pattern, backend: str, unsafe: bool = False) -> Outcome:
    """Classify ``pattern`` on ``backend``; ``unsafe`` switches its guard off in the replay arm."""
    device = _device_of(backend)
    if device == "cuda":
        from replaykit.determinism import enable_determinism  # the core's, as the parity suite uses

        enable_determinism()
    if unsafe and pattern.guard is None:
        raise ValueError(f"pattern {pattern.name!r} names no guard to switch off")
    start = time.perf_counter()
    eager = _run_arm(pattern, device, None, (), "eager")
    disable = tuple(pattern.guard.split("+")) if unsafe and pattern.guard else ()
    replay = _run_arm(pattern, device, backend, disable, "unsafe" if unsafe else "replay")
    kind, detail, diffs = classify(eager, replay)
    return Outcome(
        pattern.name, pattern.hazard, backend, kind, detail, unsafe, pattern.guard, replay.journal, diffs,
        round(time.perf_counter() - start, 3), pattern.kernel_dependent,
    )


def run_all(
    backends: Sequence[str] | str, patterns: Iterable[Pattern] | None = None, unsafe: bool = False
) -> list[Outcome]:
    """Every pattern (default: the whole catalogue) on every backend.

    Unsafe runs take the guarded patterns whose divergence this backend shows (see
    ``Pattern.cuda_only``/``cpu_only``/``unsafe_never``).
    """
    if isinstance(backends, str):
        backends = [backends]
    chosen = list(PATTERNS if patterns is None else patterns)
    return [run_pattern(p, b, unsafe=unsafe) for b in backends for p in chosen if not unsafe or shows_unsafe(p, b)]


def shows_unsafe(pattern: Pattern, backend: str) -> bool:
    """Whether ``pattern``'s unsafe arm is expected to diverge on ``backend``."""
    if pattern.guard is None or pattern.unsafe_never:
        return False
    return not (pattern.cuda_only and backend != "cuda") and not (pattern.cpu_only and backend == "cuda")


# --------------------------------------------------------------------------- table and CLI
def table(outcomes: Sequence[Outcome], markdown: bool = True) -> str:
    """The outcomes as a markdown (or plain text) table, failures flagged."""
    header = ["hazard", "pattern", "backend", "guard", "outcome", "journal"]
    rows = []
    for o in outcomes:
        flag = "FAIL " if o.failed else ""
        j = o.journal
        summary = f"rec {j.get('record', 0)} rep {j.get('replay', 0)} eager {j.get('eager', 0)}" if j else ""
        arm = " (unsafe)" if o.unsafe else ""
        rows.append([o.hazard, o.pattern + arm, o.backend, o.guard or "-", flag + o.line(), summary])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
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
    return {"replayed bitwise": "replayed", "routed eager": "eager", "retired": "retired",
            "clear error": "error", "both raise": "both raise"}.get(o.kind, "diverged" if o.unsafe else o.kind)


def rows(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One flat row per outcome, for a DataFrame or CSV."""
    return [
        {
            "hazard": o.hazard, "pattern": o.pattern, "backend": o.backend, "arm": "unsafe" if o.unsafe else "guarded",
            "guard": o.guard or "-", "verdict": verdict(o), "outcome": o.line(), "failed": o.failed,
            "records": o.journal.get("record", 0), "replays": o.journal.get("replay", 0),
            "eager": o.journal.get("eager", 0), "seconds": round(o.seconds, 3),
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
    return {
        "line": line,
        "patterns": len({o.pattern for o in guarded}),
        "runs": len(guarded),
        "silent": silent,
        "failures": sum(o.failed for o in outcomes),
        "verdicts": kinds,
        "unsafe_runs": len(unsafe),
        "unsafe_diverged": sum(o.diverged for o in unsafe),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replaykit.testing.hazards", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=["emulated", "cuda"], help="repeatable; default emulated")
    parser.add_argument("--hazard", action="append", choices=HAZARDS, help="only these hazard classes")
    parser.add_argument("--pattern", action="append", help="only these patterns, by name")
    parser.add_argument("--unsafe", action="store_true", help="switch each guard off: every arm must diverge")
    parser.add_argument("--plain", action="store_true", help="a plain text table instead of markdown")
    parser.add_argument("--json", metavar="PATH", help="write the outcomes as JSON")
    args = parser.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore", rk.ReplayWarning)
    chosen = [
        p for p in PATTERNS
        if (not args.hazard or p.hazard in args.hazard) and (not args.pattern or p.name in args.pattern)
    ]
    outcomes = run_all(args.backend or ["emulated"], chosen, unsafe=args.unsafe)
    print(table(outcomes, markdown=not args.plain))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**asdict(o), "failed": o.failed} for o in outcomes], fh, indent=1, default=str)
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
