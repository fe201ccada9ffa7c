"""Every rank routes a call the same way: the route agreed by one small all-reduce first.

Under DDP a step's collectives must pair up across ranks: a rank that records (an eager
reference run, then the capture) while another replays, or one that routes eager alone, issues
a different sequence of collectives, which hangs the job or averages gradients of different
work. So before acting, each rank's route is reduced across the process group: one all-reduce
(MAX) of two int64 (the route's code and its negation: the largest and the smallest code at
once). Equal everywhere, the route stands; otherwise every rank runs the call eagerly
(``peer_route``), the most conservative route (real DDP), and says so.

It runs only where ranks exist: ``torch.distributed`` initialised and the model DDP-wrapped, or
a process group given. On gloo the two ints are a CPU tensor; on NCCL a device tensor read back
(a host sync per step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .watchdog import Watchdog

__all__ = ["CODES", "RankAgreement"]

#: a route's code; a larger one is no less conservative (eager > record > replay)
CODES = {"replay": 0, "record": 1, "eager": 2}


class RankAgreement:
    """The route agreed across ``group`` (None: the default group) before every call acts."""

    def __init__(self, group: Any, watchdog: Watchdog | None) -> None:
        self.group = group
        self.watchdog = watchdog
        on_device = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_device else "cpu"
        self._buf = torch.zeros(2, dtype=torch.int64, device=device)
        self._host = [0, 0]

    def agree(self, route: str) -> str | None:
        """None when every rank takes ``route``; else why this rank runs eagerly instead."""
        code = CODES[route]
        buf = self._buf
        buf[0], buf[1] = code, -code
        if self.watchdog is None:
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        else:
            work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.watchdog.wait(work, "the ranks' route agreement")
        high, low = buf.tolist()
        if high == -low:
            return None
        names = {v: k for k, v in CODES.items()}
        return f"peer_route: ranks route {names[-low]} to {names[high]}; every rank runs eagerly"
