"""The recorder's event log: exact counts, and a bounded record of the events themselves."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

#: ``hold_end``: a pending backward ran or its graph was dropped; ``release``: the recorder was released;
#: ``refuse``: the probe refused a signature (its calls then run eager); ``check``: a shadow check;
#: ``rerecord``: recordings dropped for a change they cannot survive (its cause), recorded anew;
#: ``warned``: a difference from eager already made, said with a ReplayWarning (the reason names it).
KINDS: tuple[str, ...] = (
    "record",
    "replay",
    "eager",
    "backward",
    "copy_out",
    "retire",
    "rerecord",
    "hold_end",
    "release",
    "refuse",
    "check",
    "warned",
    "unsafe",
)
#: Kinds whose reasons are tallied: eager forwards, and backwards not replayed from a graph.
REASONED: tuple[str, ...] = ("eager", "backward")
#: Kinds whose every event is kept.
PINNED: frozenset[str] = frozenset({"record", "retire", "rerecord", "warned", "unsafe"})


class Event(NamedTuple):
    """One thing the recorder did: ``kind`` with an optional ``reason``, during forward call ``call``."""

    seq: int
    kind: str
    call: int
    reason: str | None = None
    detail: str | None = None


_new_event = tuple.__new__  # Event(...) without the Python frame of NamedTuple.__new__


class Journal(Sequence[Event]):
    """Ordered events, bounded for long runs. Counts are exact. Every ``record``, ``retire``,
    ``rerecord`` and ``unsafe`` event and the first event of each (kind, reason) pair are kept for
    ever; the rest keep a tail of ``tail`` events. Memory and per-event cost stay flat however many
    calls run."""

    def __init__(self, tail: int = 1000) -> None:
        if tail < 1:
            raise ValueError("tail must be >= 1")
        self._pinned: list[Event] = []
        self._tail: deque[Event] = deque(maxlen=tail)
        self._seen: set[tuple[str, str | None]] = set()
        # (kind, reason) whose next events only join the tail
        self._tails: set[tuple[str, str | None]] = set()
        self._counts: dict[str, int] = {}  # a plain dict: a Counter's ``+=`` costs twice as much
        self.reasons: dict[str, Counter[str]] = {k: Counter() for k in REASONED}
        self.total = 0

    @property
    def counts(self) -> Counter[str]:
        """Events by kind (a copy)."""
        return Counter(self._counts)

    @property
    def eager_reasons(self) -> Counter[str]:
        return self.reasons["eager"]

    @property
    def backward_reasons(self) -> Counter[str]:
        return self.reasons["backward"]

    def add(
        self, kind: str, call: int, reason: str | None = None, detail: str | None = None
    ) -> Event:
        event: Event = _new_event(Event, (self.total, kind, call, reason, detail))
        self.total += 1
        self._counts[kind] = self._counts.get(kind, 0) + 1
        if kind in self.reasons:
            self.reasons[kind][reason or "unknown"] += 1
        key = (kind, reason)
        if kind in PINNED or key not in self._seen:
            self._seen.add(key)
            self._pinned.append(event)
        else:
            self._tail.append(event)
            if kind not in self.reasons:
                self._tails.add(key)
        return event

    def tick(self, kind: str, call: int, reason: str | None = None) -> None:
        """``add`` without a detail, for the events of every replayed call (``replay``,
        ``hold_end``). The same counts and order; once an event of ``(kind, reason)`` went to the
        tail (not pinned, reason not tallied), the next ones go there in a few steps."""
        if (kind, reason) not in self._tails:
            self.add(kind, call, reason)
            return
        self._tail.append(_new_event(Event, (self.total, kind, call, reason, None)))
        self.total += 1
        self._counts[kind] += 1

    @property
    def dropped(self) -> int:
        """How many events were counted but are no longer kept."""
        return self.total - len(self)

    def _events(self) -> list[Event]:
        tail = list(self._tail)
        if not tail or not self._pinned or self._pinned[-1].seq < tail[0].seq:
            return self._pinned + tail
        return sorted(self._pinned + tail, key=lambda e: e.seq)

    def __len__(self) -> int:
        return len(self._pinned) + len(self._tail)

    def __getitem__(self, index):  # type: ignore[override]
        return self._events()[index]

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events())

    def summary(self) -> dict:
        """Counts by kind and eager reasons, for tables and notebooks."""
        return {
            "events": self.total,
            **{k: self._counts.get(k, 0) for k in KINDS},
            "eager_reasons": dict(self.eager_reasons),
            "backward_reasons": dict(self.backward_reasons),
            "rerecord_causes": [e.reason for e in self._pinned if e.kind == "rerecord"],
        }

    def format(self, limit: int = 40) -> str:
        """A readable listing of the kept events (the last ``limit``)."""
        lines = [f"journal: {self.total} events, {self.dropped} not kept"]
        for e in self._events()[-limit:]:
            why = f" ({e.reason})" if e.reason else ""
            more = f" {e.detail}" if e.detail else ""
            lines.append(f"  #{e.seq:<6} call {e.call:<6} {e.kind}{why}{more}")
        return "\n".join(lines)
