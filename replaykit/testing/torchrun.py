"""One torchrun job under a deadline: ``nproc`` processes of a module, stopped whole when late.

The DDP parity matrix and the DDP bench launch their ranks through it. torchrun starts every
worker in a session of its own, so killing torchrun alone would leave the workers of a hung
collective running (and holding the GPU): a late job gets SIGTERM, which torchrun answers by
stopping its workers (it SIGKILLs one that outlives its own 30 s grace), and whatever outlives
our grace too is killed with torchrun's process group.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

#: The jobs running now (several threads may each wait on one).
_LIVE: set[subprocess.Popen] = set()


def worker_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a module that launches its own ranks: a launched rank is told it is one by
    the hidden ``--worker`` (the path of its job's spec or output)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return ap


def stop_jobs_on_sigterm() -> None:
    """Make SIGTERM (a ``timeout`` around the driver) stop every running job before the driver
    exits: torchrun's process is in a session of its own and would outlive the driver."""

    def stop(signum: int, frame: object) -> None:
        for proc in list(_LIVE):
            proc.terminate()
        raise SystemExit(f"stopped by signal {signum}: {len(_LIVE)} torchrun job(s) stopped")

    signal.signal(signal.SIGTERM, stop)


def torchrun(module: str, args: list[str], nproc: int, timeout: float, what: str) -> str:
    """Run ``python -m module *args`` as ``nproc`` torchrun processes; returns their stdout.

    Raises ``RuntimeError`` naming ``what`` when the job fails, or outlives ``timeout`` seconds
    (a hung collective?) and was stopped."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    _LIVE.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stderr = _stop(proc)
        raise RuntimeError(
            f"{what} did not finish in {timeout:.0f} s (a hung collective?); the processes were "
            f"stopped:\n{stderr[-3000:]}"
        ) from None
    finally:
        _LIVE.discard(proc)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
        )
    return stdout


def _stop(proc: subprocess.Popen, grace: float = 45) -> str:
    """End a late job and its workers; returns its stderr so far."""
    proc.terminate()
    try:
        return proc.communicate(timeout=grace)[1] or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # a worker that escaped would hold the pipes open: do not wait on it for ever
            return proc.communicate(timeout=5)[1] or ""
        except subprocess.TimeoutExpired:
            proc.wait()
            return "(torchrun killed; a worker may still hold its output)"
