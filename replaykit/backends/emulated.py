"""The emulated backend: what a CUDA graph freezes and how its buffers behave, on any device.

It mirrors ``cuda.py``: warm-up on stand-ins, then one forward recorded as a
:class:`~replaykit.backends.tape.Tape`. A replay runs the tape, never the module's Python, so a
CPU run shows what a GPU run would do when a host value changes and no guard catches it. Its
saved tensors resolve to the latest replay's activations (one set per recording: what the hold
protects); static outputs and gradient buffers are overwritten in place without a version
bump. What a capture refuses is refused at record (``capture failed: ...``), seeding torch's
generator included (:class:`~.seeding.SeedingRefused`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.cuda.random
import torch.random

from ..errors import ReplayError
from ..guards.signature import autocast_key
from ..guards.switches import Frozen
from ..memory.pool import MemoryPool
from ..verify.bitwise import all_equal
from .base import (
    Backend,
    Recording,
    Region,
    Subject,
    differentiable_indices,
)
from .gaps import open_gaps
from .host_feeds import Spec
from .scratch import Exposure, Scratch, TrackedScratch
from .seeding import SeedingRefused
from .tape import Tape, record


def _zero_grads(outputs: list[torch.Tensor], diff: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros_like(outputs[i]) for i in diff]


def _check_dense(grads: Sequence[torch.Tensor | None], names: Sequence[str]) -> None:
    for g, name in zip(grads, names, strict=True):
        if g is not None and g.layout != torch.strided:
            raise ReplayError(
                f"{name} gets a {g.layout} gradient (e.g. nn.Embedding(sparse=True)); "
                "a graph's static gradient buffers are dense: use sparse=False"
            )


class EmulatedRecording(Recording):
    """A recording whose forward 'graph' is a tape of aten calls and whose backward is its autograd graph."""

    def __init__(self, subject: Subject) -> None:
        self._tape: Tape | None = None
        leaves = self._stand_ins(subject)
        static_inputs, params = subject.static_inputs, subject.params
        names = [f"input {i}" for i, x in enumerate(static_inputs) if x.requires_grad]
        names += [f"parameter {i} ({tuple(p.shape)})" for i, p in enumerate(params)]
        device = next((t.device.type for t in (*static_inputs, *params)), "cpu")
        enabled, dtype = autocast_key(device)

        def forward() -> list[torch.Tensor]:
            # the cast cache off: a cast cached by warm-up would reach the tape as a frozen constant
            with (
                torch.enable_grad(),
                torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False),
            ):
                return self._outputs(subject, leaves)

        for _ in range(subject.warmup):
            outs = forward()
            diff = differentiable_indices(outs)
            if diff and self._targets:
                _check_dense(
                    self._grad([outs[i] for i in diff], _zero_grads(outs, diff), False), names
                )
            del outs

        with SeedingRefused():
            tape, outs = record(forward, [*static_inputs, *leaves], subject.generators)
        self.differentiable = differentiable_indices(outs)
        self.static_outputs = outs
        grads: Sequence[torch.Tensor | None] = [None] * len(self._targets)
        if self.differentiable and self._targets:
            grads = self._repeatable_backward([outs[i] for i in self.differentiable], names)
        self.static_grads = [None if g is None else torch.empty_like(g) for g in grads]
        del grads
        tape.seal(outs)
        del outs
        self._tape = tape

    def _repeatable_backward(
        self, roots: list[torch.Tensor], names: Sequence[str]
    ) -> Sequence[torch.Tensor | None]:
        """The recorded graph differentiated twice with the same (nonzero) gradients: every replay
        differentiates this one graph again, where eager and a CUDA graph run the backward once
        per forward. A graph whose backward runs Python that consumes what it reads (selective
        activation checkpointing's cache: torch 2.13 raises at the second backward, 2.11 pops one
        entry per early-stopped recompute, so the second reads another op's output and a later
        one raises) fails here, a clean "capture failed", never in the user's backward."""
        ones = [torch.ones_like(r) for r in roots]
        first = self._grad(roots, ones, True)
        _check_dense(first, names)
        again = self._grad(roots, ones, True)
        if not all_equal(zip(first, again, strict=True)):
            raise ReplayError(
                "the recorded backward is not repeatable: a second backward through the recorded "
                "graph gives other gradients (a saved-tensor hook or custom autograd.Function that "
                "consumes a cache, as selective activation checkpointing does), and every replay "
                "backwards that graph again"
            )
        return first

    def _grad(
        self, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        if not roots or not self._targets:
            return [None] * len(self._targets)
        # the backward's kernels are the recording's too (None while recording: the switches of now)
        tape = self._tape
        with Frozen(tape.switches) if tape is not None else contextlib.nullcontext():
            return torch.autograd.grad(
                list(roots), self._targets, list(grads), retain_graph=retain, allow_unused=True
            )

    def replay_forward(self) -> None:
        assert self._tape is not None, "replay of a freed recording"
        self._tape.replay()  # rewrites static_outputs in place: they are the recorded outputs
        self.generation += 1

    def backward(
        self, grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], str | None]:
        if any(g is None for g in grads):
            return self._partial(grads), "partial"
        return self._replay_backward(grads), None  # type: ignore[arg-type]

    def _replay_backward(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        computed = self._grad([self.static_outputs[i] for i in self.differentiable], grads, True)
        out: list[torch.Tensor | None] = []
        handed = self.handed_grads or self.static_grads
        with torch.no_grad():
            for static, g, h in zip(self.static_grads, computed, handed, strict=True):
                if static is None or g is None or h is None:
                    out.append(None)
                else:
                    # in place and, like a graph replay, without a version bump
                    static.data.copy_(g)
                    out.append(h.detach())
        return out

    def _partial(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        pairs = [(i, g) for i, g in zip(self.differentiable, grads, strict=True) if g is not None]
        return list(
            self._grad([self.static_outputs[i] for i, _ in pairs], [g for _, g in pairs], True)
        )

    def exact_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return self._partial(grads)

    def free(self) -> None:
        if self._tape is not None:
            self._tape.free()
        self._tape = None
        self.static_outputs = []
        self.static_grads = []
        self.static_inputs = []


class EmulatedBackend(Backend):
    """Frozen replay with CUDA-graph buffer semantics, on any device."""

    name = "emulated"

    def __init__(self, pool: MemoryPool | None = None) -> None:
        if pool is not None:
            pool.emulated = True  # a claim then overwrites what a CUDA replay may overwrite
        self._exposure = Exposure()  # scratch survivors an earlier region's replay overwrites

    def record(self, subject: Subject) -> Recording:
        return EmulatedRecording(subject)

    def region(self, fixed: Sequence[torch.Tensor]) -> Region:
        return TapeRegion(fixed, self._exposure)


class TapeRegion(Region):
    """A tape of aten calls over the static inputs (fixed slots); the capture runs the body. The
    replay runs the recorded aten sequence without the Python: a host value the body read (a float
    lr, a clip threshold, ``dropout.p``) is frozen exactly as in a graph."""

    def __init__(self, fixed: Sequence[torch.Tensor], exposure: Exposure) -> None:
        self.tape = Tape(fixed)
        self._exposure = exposure
        self._born = exposure.epoch  # survivors of later scratch runs are in its way

    def capture(
        self, body: Callable[[], list[torch.Tensor]], host_feeds: Sequence[Spec] | None = None
    ) -> list[torch.Tensor]:
        self._born = self._exposure.epoch  # a capture sees what is live: it is not in its way
        with self.tape.recording(), SeedingRefused(), open_gaps(self):
            outs = body()
        self.tape.seal(outs)
        return outs

    def gap(self, bind: Callable[[], Callable[[], None]], first: bool) -> None:
        """Host work (:mod:`.gaps`): bound and run now, unwatched and untaped, and kept as one more
        entry of the tape (a replay runs it in the body's order)."""
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            work = bind()
            work()
        self.tape.add_work(work)

    def replay(self) -> None:
        self._exposure.overwrite(self._born)
        self.tape.replay()

    def scratch(self) -> Scratch:
        return TrackedScratch(self._exposure)

    def free(self) -> None:
        self.tape.free()
