"""Writes into the model an eager call makes now and then: a cache filled on first use or at a new shape.

A forward that assigns module state (a RoPE table re-assigned when a longer sequence arrives,
a buffer created at the first call) makes a recording of that call wrong for later calls: a
replay would not assign again. But a write that does not recur at the next call is a new
state, not a per-call effect: the call that makes it runs eagerly (its run stands), the
recordings made for the old state are dropped (journal ``rerecord``, within
``max_rerecords``) and the next call records for the new state. A write at two calls in a
row is per-call Python (a counter, an attribute set every step): the entry point retires.
"""

from __future__ import annotations

__all__ = ["Fills"]


class Fills:
    """Per entry point: which of its writes into the model are fills (new state) and which recur."""

    __slots__ = ("_last", "_seen")

    def __init__(self) -> None:
        self._seen = False
        self._last = -2  # the call of the last write

    def verdict(self, call: int) -> str:
        """For a writes-only effect found at ``call``: ``"first_write"`` (the first one: that call
        eager, as always), ``"fill"`` (a new state: re-record) or ``"repeats"`` (the call before
        wrote too: retire)."""
        last, self._last = self._last, call
        if not self._seen:
            self._seen = True
            return "first_write"
        return "repeats" if call - last <= 1 else "fill"
