"""A region graph: any stretch of work (a whole training step) recorded once and replayed.

Network replay (:class:`~replaykit.backends.base.Recording`) connects a recorded
forward and backward to autograd. A whole step needs less: run a body once while
recording it, then replay it over the same tensors. Both backends leave the recording
call's work *done*, so the call that records is an ordinary training step:

- ``cuda``: ``torch.cuda.graph`` capture (which executes nothing), then one replay;
- ``emulated``: the body runs under the :class:`~replaykit.backends.tape.Tape`, whose
  replay runs the recorded aten sequence without the Python: a host value the body read
  (a float lr, a clip threshold, ``dropout.p``) is frozen exactly as in a graph.

Tensors the body reads by reference (parameters, gradients, optimizer state, a tensor
lr) are read again at every replay, at the same address (cuda) or object (emulated).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from .tape import Tape


class Region(ABC):
    """One recorded body. ``capture`` runs it once (its work is done); ``replay`` runs it again."""

    @abstractmethod
    def capture(self, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Record ``body`` and leave its work done; returns its (static) output tensors."""

    @abstractmethod
    def replay(self) -> None:
        """Run the recorded work again over the same tensors."""

    @abstractmethod
    def free(self) -> None:
        """Give back what the recording holds."""


class CudaRegion(Region):
    """A ``torch.cuda.CUDAGraph`` in the step's private pool (shared by its recordings)."""

    def __init__(self, device: torch.device, pool: tuple) -> None:
        self.device = device
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outs = body()
        self.graph = graph
        graph.replay()  # a capture executes nothing: this is the recording call's step
        return outs

    def replay(self) -> None:
        assert self.graph is not None
        self.graph.replay()

    def free(self) -> None:
        self.graph = None


class TapeRegion(Region):
    """The emulated backend: a tape of aten calls over the static inputs (fixed slots)."""

    def __init__(self, fixed: Sequence[torch.Tensor]) -> None:
        self.tape = Tape(fixed)

    def capture(self, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        with self.tape.recording():
            outs = body()
        self.tape.seal(outs)
        return outs

    def replay(self) -> None:
        self.tape.replay()

    def free(self) -> None:
        self.tape.free()
