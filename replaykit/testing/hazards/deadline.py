"""A time limit on one pattern run, so that a hang is a failure and not a stuck CI.

A thread cannot be stopped from outside, so a watcher thread with a join timeout would
report a hang and leave it running. Two ways that can stop one instead:

- in this process (every pattern, nearly free): ``SIGALRM`` raises :class:`Timeout` in
  the main thread at the deadline. That ends Python-level hangs (a loop that never ends,
  a wait on a lock or a thread: CPython runs the handler between bytecodes and interrupts
  blocking waits), but not native code that never returns to the interpreter;
- in a child process (patterns marked ``may_hang``: a CUDA capture or the autograd
  engine blocked in C++): :func:`run_child` starts a fresh interpreter and kills it at
  the deadline. It costs an interpreter and a torch import per run, so only the patterns
  known to risk a native hang pay it.

The last resort for a native hang in a pattern not (yet) marked ``may_hang``:
``faulthandler`` dumps every thread's stack and ends the process at a later deadline,
so CI fails with the stuck pattern named instead of waiting for ever.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

#: The line a child prints when it starts the pattern (its deadline runs from there).
READY = "hazard-child-ready"


class Timeout(BaseException):  # a BaseException: no ``except Exception`` in a pattern swallows it
    """The pattern ran past its deadline."""


@contextlib.contextmanager
def alarm(seconds: float, last_resort_s: float | None = None) -> Iterator[None]:
    """Raise :class:`Timeout` after ``seconds`` (main thread, POSIX); end the process with
    every stack dumped after ``last_resort_s`` (default ``2 * seconds + 60``) if even that
    did not stop it."""
    watched = _last_resort(last_resort_s or 2 * seconds + 60)
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous = None
    if usable:

        def _raise(signum: int, frame: object) -> None:
            raise Timeout(f"no end after {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, _raise)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if usable:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if watched:
            faulthandler.cancel_dump_traceback_later()


def _last_resort(seconds: float) -> bool:
    """Arm faulthandler's watchdog on the process's own stderr (a notebook's ``sys.stderr``
    has no file descriptor); False where there is none to write to."""
    stream = sys.__stderr__
    try:
        stream.fileno()  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):
        return False
    faulthandler.dump_traceback_later(seconds, exit=True, file=stream)
    return True


@dataclass
class ChildResult:
    """How a child run ended: ``status`` is ``done``, ``timeout`` or ``crashed`` (no start, or an exit before its answer)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None


def run_child(argv: list[str], seconds: float, start_s: float = 120.0) -> ChildResult:
    """Run ``argv`` (a Python that prints :data:`READY`, then its answer) with this
    interpreter's import path; kill it ``seconds`` after it is ready, or ``start_s`` after
    the start if it never gets there."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        try:
            ready = select.select([proc.stdout], [], [], start_s)[0]
            if not ready or proc.stdout.readline().strip() != READY:
                proc.kill()
                proc.wait()
                err.seek(0)
                return ChildResult("crashed", stderr=err.read(), returncode=proc.returncode)
            try:
                out, _ = proc.communicate(timeout=seconds)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                return ChildResult("timeout", returncode=proc.returncode)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        status = "done" if proc.returncode == 0 else "crashed"
        return ChildResult(status, out, err.read(), proc.returncode)
