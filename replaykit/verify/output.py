"""What a recording call's extra runs print and log, held back until the call knows which run stands.

A recording call runs the Python more than once; tensors are put back between runs
(:mod:`.call_state`), output cannot be. So the recording thread's stdout, stderr and log records
are held per run and only the standing run's are emitted, once per call as eager prints.
Warnings are held as warnings: one shown by a dropped run would enter ``__warningregistry__``
and never show again, so the registries are put back (:class:`WarningRegistries`) and the
standing run's warnings issued again, for the filters to decide as for one eager call.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ReplayWarning

__all__ = ["HeldOutput", "WarningRegistries"]

_original_handle = logging.Logger.handle
_original_showwarning = warnings.showwarning
_lock = threading.Lock()
# thread id -> the output being held there (innermost last)
_holders: dict[int, list[HeldOutput]] = {}


class _Stream:
    """Stands in for ``sys.stdout`` or ``sys.stderr`` while a run's output is held."""

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
        # files the run's own code opened for writing: no run can take a write back
        self.written_files: list[str] = []

    @contextmanager
    def held(self) -> Iterator[HeldOutput]:
        if not self._held:
            yield self
            return
        me = threading.get_ident()
        with _lock:
            if not _holders:
                _watch_opens()
                sys.stdout = _Stream(sys.stdout, "stdout")
                sys.stderr = _Stream(sys.stderr, "stderr")
                global _original_showwarning
                _original_showwarning = warnings.showwarning
                warnings.showwarning = _showwarning
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
            elif where == "warning":
                _warn_again(*item)
            else:
                getattr(sys, where).write(item)

    def drop(self) -> None:
        """Forget what the run printed (a run that does not stand as the call)."""
        self.items = []


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_original_open, _original_os_open = builtins.open, os.open


def _watch_opens() -> None:
    """``open`` (builtins' and io's) and ``os.open`` note a file a held run opens for writing;
    put back with the streams (not an audit hook: one runs at every ``id()`` for good)."""
    builtins.open = io.open = _open  # type: ignore[assignment]
    os.open = _os_open  # type: ignore[assignment]


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    if any(c in mode for c in "wax+"):
        _note(file)
    return _original_open(file, mode, *args, **kwargs)


def _os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
    if flags & _WRITE_FLAGS:
        _note(path)
    return _original_os_open(path, flags, *args, **kwargs)


def _note(path: Any) -> None:
    held = _holders.get(threading.get_ident())
    if held and _users_code(sys._getframe(2)):
        held[-1].written_files.append(str(path))


def _users_code(frame: Any) -> bool:
    """Whether the nearest frame outside the standard library's I/O is the user's code, not a
    library's (torch's compile caches, triton's, a tempfile): those are not the step's effects."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        root = name.partition(".")[0]
        if root not in ("io", "_io", "os", "codecs", "pathlib", "builtins", "_pyio"):
            return root not in sys.stdlib_module_names and not _library_file(
                frame.f_code.co_filename
            )
        frame = frame.f_back
    return False


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _library_file(path: str) -> bool:
    return "site-packages" in path or "dist-packages" in path or path.startswith(_PACKAGE)


def _showwarning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` while a run is held: the warning and its module's globals are kept."""
    held = _holders.get(threading.get_ident())
    if not held or file is not None or issubclass(category, ReplayWarning):
        # replaykit's own (a nested entry point retiring) is about state no run puts back
        _original_showwarning(message, category, filename, lineno, file, line)
        return
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_filename == filename and frame.f_lineno == lineno
    ):
        frame = frame.f_back
    where = frame.f_globals if frame is not None else None
    held[-1].items.append(("warning", (message, category, filename, lineno, where)))


def _warn_again(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, where: dict | None
) -> None:
    """A held warning issued again where it was issued, through the filters and its registry."""
    if where is None:
        warnings.warn_explicit(message, category, filename, lineno)
        return
    registry = where.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message, category, filename, lineno, where.get("__name__"), registry, where
    )


class WarningRegistries:
    """Every module's ``__warningregistry__`` (and ``warnings.onceregistry``) as it is now:
    :meth:`restore` forgets what the runs since registered (the standing run's warnings are
    issued again, and register then)."""

    def __init__(self) -> None:
        now = _registries()
        self._saved = [(r, dict(r)) for r in now.values()]
        self._known = set(now)

    def restore(self) -> None:
        for registry, saved in self._saved:
            if registry != saved:
                registry.clear()
                registry.update(saved)
        for key, registry in _registries().items():
            if key not in self._known:
                registry.clear()


def _registries() -> dict[int, dict]:
    """The registries that exist now, by id: the modules' and the ``once`` one."""
    found = {id(warnings.onceregistry): warnings.onceregistry}
    for module in list(sys.modules.values()):
        registry = getattr(module, "__dict__", {}).get("__warningregistry__")
        if isinstance(registry, dict):
            found[id(registry)] = registry
    return found


def _unwrap() -> None:
    """The streams and the logger's ``handle`` as they were (a stream replaced meanwhile is left)."""
    if isinstance(sys.stdout, _Stream):
        sys.stdout = sys.stdout._original
    if isinstance(sys.stderr, _Stream):
        sys.stderr = sys.stderr._original
    logging.Logger.handle = _original_handle  # type: ignore[method-assign]
    if builtins.open is _open:
        builtins.open = _original_open
    if io.open is _open:
        io.open = _original_open
    if os.open is _os_open:
        os.open = _original_os_open
    if warnings.showwarning is _showwarning:
        warnings.showwarning = _original_showwarning
