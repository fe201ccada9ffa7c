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
  known to risk a native hang pay it. On the CPU a :class:`Worker` serves those runs one
  after another from one child (the import paid once: ~2 s a run saved), killed and
  replaced when a run outlives its deadline; a CUDA run keeps a fresh child of its own (a
  failed capture can leave its context unusable for the next run).

The last resort for a native hang in a pattern not (yet) marked ``may_hang``:
``faulthandler`` dumps every thread's stack and ends the process at a later deadline,
so CI fails with the stuck pattern named instead of waiting for ever.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: The line a child prints when it starts the pattern (its deadline runs from there).
READY = "hazard-child-ready"
#: A :class:`Worker`'s answer line starts with this (what the pattern prints is not its answer).
ANSWER = "hazard-child-answer "


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


def checked_row(
    label: str, check: Callable[[], tuple[bool, str]], seconds: float, width: int = 44
) -> bool:
    """Run one GPU-script check under a deadline and print its ``PASS``/``FAIL`` row (label, time,
    detail): a check that hangs or raises is a FAIL row, not a stopped table. Returns whether it passed."""
    t0 = time.perf_counter()
    try:
        with alarm(seconds):
            ok, detail = check()
    except Timeout:
        ok, detail = False, f"timed out after {seconds:g} s"
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {str(exc)[:160]}"
    print(
        f"{'PASS' if ok else 'FAIL'}  {label:{width}} {time.perf_counter() - t0:6.1f}s  {detail}",
        flush=True,
    )
    return ok


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
    env = child_env()
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


def child_env() -> dict[str, str]:
    """This process's environment with its import path: the child finds what this process finds."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


class Worker:
    """One child interpreter that answers requests one after another, each under its own deadline.

    ``argv`` starts a Python that reads one JSON request per line on stdin and, for each, prints
    :data:`READY`, then a line :data:`ANSWER` + its answer (:func:`serve`). A request that outlives
    its deadline, or a child that dies, ends the child; the next request starts a new one. What
    :func:`run_child` does per run, with the interpreter start and imports paid once.
    """

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.path = tuple(sys.path)  # the import path the child was started with
        self.proc: subprocess.Popen[bytes] | None = None
        self._err: Any = None
        self._buffer = b""
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[bytes]:
        self.close()  # one that died between requests
        if self._err is not None:
            self._err.close()
        self._err = tempfile.TemporaryFile("w+b")  # noqa: SIM115 - lives as long as the child
        self._buffer = b""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=child_env(),
        )
        return self.proc

    def _line(self, seconds: float) -> str | None:
        """The child's next stdout line; None past ``seconds``, "" at its end (EOF)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + seconds
        while b"\n" not in self._buffer:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace") + "\n"

    def request(self, args: list[str], seconds: float, start_s: float = 120.0) -> ChildResult:
        """Run ``args`` in the child: killed ``seconds`` after it is ready, or ``start_s`` after the
        request if it never gets there (a fresh child imports first). One request at a time."""
        with self._lock:
            return self._request(args, seconds, start_s)

    def _request(self, args: list[str], seconds: float, start_s: float) -> ChildResult:
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None
        err_from = self._err.seek(0, os.SEEK_END)
        try:
            proc.stdin.write((json.dumps(args) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            return self._ended("crashed", err_from)
        line = self._line(start_s)
        if line is None or line.strip() != READY:
            return self._ended("crashed", err_from)
        out: list[str] = []
        end = time.monotonic() + seconds
        while True:
            line = self._line(max(end - time.monotonic(), 0.0))
            if line is None:
                return self._ended("timeout", err_from)
            if not line:
                return self._ended("crashed", err_from, "".join(out))
            if line.startswith(ANSWER):
                out.append(line[len(ANSWER) :])
                return ChildResult("done", "".join(out), "", 0)
            out.append(line)

    def _ended(self, status: str, err_from: int, out: str = "") -> ChildResult:
        """Kill the child (a timeout, a crash): the next request starts a fresh one."""
        code = self.close()
        self._err.seek(err_from)
        err = self._err.read().decode(errors="replace") if status == "crashed" else ""
        self._err.close()
        return ChildResult(status, out, err, code)

    def close(self) -> int | None:
        """Kill the child (it holds no state worth a graceful exit); its exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return code


def serve(run: Callable[[list[str]], str]) -> int:
    """A :class:`Worker` child's loop: for each request line, :data:`READY`, then ``run``'s answer."""
    for line in sys.stdin:
        if not line.strip():
            continue
        print(READY, flush=True)
        answer = run(json.loads(line))
        print("\n" + ANSWER + answer, flush=True)  # a line of its own: the run's may be unended
    return 0


_workers: dict[tuple[str, ...], Worker] = {}


def shared_worker(argv: list[str]) -> Worker:
    """The worker of ``argv`` for this process (one per command line), replaced when the import path
    changed since it started (a child must find what this process finds); ended at exit."""
    key = tuple(argv)
    worker = _workers.get(key)
    if worker is not None and worker.path != tuple(sys.path):
        worker.close()
        worker = None
    if worker is None:
        worker = _workers[key] = Worker(argv)
    return worker


@atexit.register
def _close_workers() -> None:
    for worker in _workers.values():
        worker.close()
