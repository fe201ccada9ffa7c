"""A timeout on a replayed step's waits, so a stuck collective is an error naming the rank.

A replayed graph is invisible to the process group's own watchdog, and a rank that waits for a
peer routing differently waits for ever (gloo's default timeout is 30 minutes). With
``replay_timeout=seconds`` the collectives replaykit issues (the route agreement, DDP's
all-reduce between the graphs) are waited on with that timeout, and on CUDA the replayed work
is waited on too (an event, polled): past it, :class:`~replaykit.errors.ReplayError` says which
rank waited for what. Off (the default) nothing is added to the replay path: the step holds no
watchdog and the collectives are issued as DDP issues them.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from ..errors import ReplayError

__all__ = ["Watchdog"]


class Watchdog:
    """Waits with a deadline; ``rank``: the global rank named in the error."""

    def __init__(self, timeout: float, rank: int) -> None:
        self.timeout = float(timeout)
        self.rank = rank
        self._delta = timedelta(seconds=self.timeout)

    def wait(self, work: Any, what: str) -> None:
        """Wait for an async collective's ``work``; past the timeout raise, naming the rank."""
        try:
            done = work.wait(timeout=self._delta)
        except RuntimeError as exc:
            raise self.error(what, exc) from exc
        if done is False:
            raise self.error(what, None)

    def device(self, device: torch.device, what: str) -> None:
        """Wait for the work queued on ``device``'s stream (a replayed graph), polling an event."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        end = time.monotonic() + self.timeout
        while not event.query():
            if time.monotonic() > end:
                raise self.error(what, None)
            time.sleep(0.0002)

    def error(self, what: str, cause: BaseException | None) -> ReplayError:
        why = f": {cause}" if cause is not None else ""
        return ReplayError(
            f"replaykit: rank {self.rank} waited more than {self.timeout:g} s for {what} "
            f"(replay_timeout){why}; a peer rank is stuck or routes differently"
        )
