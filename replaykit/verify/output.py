"""What a recording call's extra runs print and log, held back until the call knows which run stands.

A recording call runs the step's Python more than once (probe, eager reference, capture).
Tensors and Python values are put back between runs (:mod:`.call_state`); what they wrote to
the terminal or a log cannot be. So each run's prints (``sys.stdout``) and log
records (``logging``) are held, and the call emits those of the one run that stands as eager's
— once per call, as eager prints — and drops the others. Only the recording thread's output is
held: another thread printing meanwhile goes straight through. ``sys.stderr`` is not held: a
warning is shown once per place (``warnings``' registry), and one shown by a run that does not
stand would never be shown again.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["HeldOutput"]

_original_handle = logging.Logger.handle
_lock = threading.Lock()
_holders: dict[
    int, list[HeldOutput]
] = {}  # thread id -> the output being held there (innermost last)


class _Stream:
    """Stands in for ``sys.stdout`` while a run's output is held."""

    def __init__(self, original: Any, name: str) -> None:
        self._original = original
        self._name = name

    def write(self, text: str) -> int:
        held = _holders.get(threading.get_ident())
        if not held:
            return self._original.write(text)
        held[-1].items.append((self._name, text))
        return len(text)

    def flush(self) -> None:
        if not _holders.get(threading.get_ident()):
            self._original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def _handle(logger: logging.Logger, record: logging.LogRecord) -> None:
    held = _holders.get(threading.get_ident())
    if not held:
        _original_handle(logger, record)
        return
    held[-1].items.append((logger, record))


class HeldOutput:
    """One run's prints and log records (``with output.held(): ...``), emitted by :meth:`emit`."""

    def __init__(self, held: bool = True) -> None:
        self.items: list[tuple[Any, Any]] = []
        self._held = held  # False: the run prints as it goes (nothing held)

    @contextmanager
    def held(self) -> Iterator[HeldOutput]:
        if not self._held:
            yield self
            return
        me = threading.get_ident()
        with _lock:
            if not _holders:
                sys.stdout = _Stream(sys.stdout, "stdout")
                logging.Logger.handle = _handle  # type: ignore[method-assign]
            _holders.setdefault(me, []).append(self)
        try:
            yield self
        finally:
            with _lock:
                stack = _holders[me]
                stack.remove(self)
                if not stack:
                    del _holders[me]
                if not _holders:
                    _unwrap()

    def emit(self) -> None:
        """Write what the run printed and logged, in order; the record is then empty."""
        items, self.items = self.items, []
        for where, item in items:
            if isinstance(where, logging.Logger):
                where.handle(item)
            else:
                getattr(sys, where).write(item)

    def drop(self) -> None:
        """Forget what the run printed (a run that does not stand as the call)."""
        self.items = []


def _unwrap() -> None:
    """The streams and the logger's ``handle`` as they were (a stream replaced meanwhile is left)."""
    if isinstance(sys.stdout, _Stream):
        sys.stdout = sys.stdout._original
    logging.Logger.handle = _original_handle  # type: ignore[method-assign]
