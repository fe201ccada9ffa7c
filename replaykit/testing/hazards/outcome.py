"""What one pattern run comes to: the outcome kinds, the bitwise comparison of two end states,
and the classification of a replay arm against its eager arm (run by :mod:`.runner`).

Outcomes, per pattern and backend (the replay arm against the eager arm):

- ``replayed bitwise``: end states equal bit for bit, the journal has a replay;
- ``routed eager``: equal, nothing replayed, the journal's eager reasons;
- ``retired``: equal, the recorder retired, with its reason;
- ``clear error``: the replay raised ``ReplayError``, eager did not;
- ``both raise``: eager raised and so did the replay;
- failures: ``SILENT DIFF`` (the first differing tensor, max abs difference, max ULP
  distance), ``eager raised, replay did not``, ``unclear error`` (the replay raised
  something other than ``ReplayError`` that eager did not), ``hang`` (past the deadline),
  ``crashed`` (a child process that ended without an answer).

*Replay coverage* (:func:`.report.coverage`): per API and backend, the share of the realistic
patterns run (the catalogue's, not its known limits, nor those whose eager arm raises: eager
code that fails has nothing to replay) whose outcome is ``replayed bitwise``: routing everything
eager keeps the contract but replays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import replaykit as rk
from replaykit.verify import bitwise

REPLAYED = "replayed bitwise"
ROUTED = "routed eager"
RETIRED = "retired"
CLEAR_ERROR = "clear error"
BOTH_RAISE = "both raise"
SILENT_DIFF = "SILENT DIFF"
EAGER_ONLY_RAISED = "eager raised, replay did not"
UNCLEAR_ERROR = "unclear error"
HANG = "hang"
CRASHED = "crashed"
#: the replay differs and replaykit said so when it happened (a ReplayWarning, journal kind ``warned``)
WARNED_DIFF = "differs, warned"
#: What breaks the contract; an unsafe arm must show one of these to prove its guard is needed.
DIVERGENCES = (SILENT_DIFF, EAGER_ONLY_RAISED, UNCLEAR_ERROR)
FAILURES = (*DIVERGENCES, HANG, CRASHED)

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
    """Every tensor of ``actual`` that differs bitwise from ``expected`` (``replaykit.verify.bitwise``), in ``expected``'s order."""
    diffs: list[Diff] = []
    for name in [*expected, *(n for n in actual if n not in expected)]:
        if name not in expected or name not in actual:
            diffs.append(
                Diff(name, "missing", detail="in eager" if name not in expected else "in replay")
            )
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
            detail = (
                f"{a.dtype} vs {b.dtype}"
                if row.problem == "dtype"
                else f"{tuple(a.shape)} vs {tuple(b.shape)}"
            )
            diffs.append(Diff(name, row.problem, detail=detail))
        else:
            ulp = row.max_ulp if a.is_floating_point() else None
            max_abs = 0.0 if row.max_abs != row.max_abs else row.max_abs  # NaN-only differences
            diffs.append(Diff(name, "values", max_abs, ulp))
    return diffs


def _what(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"tensor{tuple(t.shape)}"


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
    api: str = "capture"

    @property
    def failed(self) -> bool:
        """A failure of the contract; for an unsafe arm, a run that did not diverge (unless that
        depends on the machine): its hang or crash is the proof the guard is needed (it ran in a
        child process, killed at its deadline)."""
        if self.unsafe:
            return not self.diverged and not self.kernel_dependent
        return self.kind in FAILURES

    @property
    def diverged(self) -> bool:
        """The contract broke: a silent difference, a swallowed eager error, an unclear error, a hang
        or a crash.

        For an unsafe arm that is the proof its guard is needed (a data-dependent shape
        without its guard fails loudly on the emulated backend, silently on CUDA; a captured
        block inside checkpoint's recompute hangs a CUDA capture).
        """
        return self.kind in FAILURES

    def line(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


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
        kind = WARNED_DIFF if replay.journal.get("warned") else SILENT_DIFF
        return kind, f"{diffs[0]}{more}", [str(d) for d in diffs]
    journal = replay.journal
    if journal.get("retired") and journal.get("retire_reason") != "released":
        return RETIRED, str(journal.get("retire_reason")), []
    if journal.get("replay", 0) >= 1:
        reasons = journal.get("eager_reasons") or {}
        return REPLAYED, f"also eager: {_reasons(reasons)}" if reasons else "", []
    return ROUTED, _reasons(journal.get("eager_reasons") or {}), []


def _reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items())) or "no eager reason journaled"
