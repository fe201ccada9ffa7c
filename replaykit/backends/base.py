"""The small interface every backend implements: record a forward+backward (:class:`Recording`) or a
whole step (:class:`Region`) once, and replay it."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..memory.outputs import OutputTree, split_outputs
from .host_feeds import Spec
from .scratch import Scratch

#: Runs the module's own forward on the static inputs and returns its output tree;
#: ``fn(*inputs, params=leaves)`` runs it with ``leaves`` standing in for the parameters.
ForwardFn = Callable[..., Any]


@dataclass(frozen=True)
class Subject:
    """What one recording captures: ``fn`` over ``static_inputs`` with ``params``, after ``warmup``
    eager runs; one value every backend's ``record`` and recording takes. ``generators``: the
    module's own torch.Generators the forward draws from, registered with the recording so that
    each replay draws from them where eager would (any other private generator is refused).
    ``host_feeds``: host data the forward copies to the GPU is copied again at each replay
    (:mod:`.host_feeds`: learnt in the warm-up; set after a capture failed on such a copy)."""

    fn: ForwardFn
    static_inputs: list[torch.Tensor]
    params: list[torch.Tensor]
    warmup: int
    generators: tuple[torch.Generator, ...] = ()
    host_feeds: bool = False


def flatten_outputs(outputs: Any) -> tuple[list[torch.Tensor], OutputTree]:
    """A forward's output tensors and the rest of its tree (structure, constants); raises for an
    object a replay cannot rebuild (:mod:`replaykit.memory.outputs`)."""
    return split_outputs(outputs)


class Recording(ABC):
    """One input signature's forward and backward, with its static buffers. Every replay overwrites
    the static outputs and gradient buffers in place; one set of saved activations serves the latest
    forward only. ``targets``: inputs requiring grad, then parameters."""

    static_inputs: list[torch.Tensor]
    static_outputs: list[torch.Tensor]
    out_spec: OutputTree  # the outputs' structure and constant leaves
    differentiable: tuple[int, ...]
    params: list[torch.Tensor]
    static_grads: list[torch.Tensor | None]  # one per target (None: unreached, or not captured yet)
    # what a replayed backward hands out in place of ``static_grads``, one per target: views of the
    # same memory on storage objects of copy-out's (memory/copy_out.py), kept up to date in place
    # by it; None: the buffers themselves
    handed_grads: list[torch.Tensor | None] | None = None
    # host memory the graphs copy from at each replay (a capture's pinned staging): kept with them
    host_memory: list[torch.Tensor] | None = None
    generation: int = 0
    _builder: Callable[[Sequence[torch.Tensor]], Any] | None = None

    @functools.cached_property
    def inputs_requiring_grad(self) -> tuple[bool, ...]:
        """Which static inputs get a gradient (fixed for the recording)."""
        return tuple(x.requires_grad for x in self.static_inputs)

    @functools.cached_property
    def frozen_outputs(self) -> tuple[int, ...]:
        """Indices of the outputs that carry no gradient (fixed for the recording)."""
        return tuple(i for i in range(len(self.static_outputs)) if i not in self.differentiable)

    def _stand_ins(self, subject: Subject) -> list[torch.Tensor]:
        """Leaves standing in for ``params``: the recording differentiates these, not the module's."""
        self.static_inputs, self.params = subject.static_inputs, subject.params
        leaves = [p.detach().requires_grad_(True) for p in subject.params]
        self._targets = grad_targets(subject.static_inputs, leaves)
        return leaves

    def _outputs(self, subject: Subject, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """One run of ``subject.fn`` on the stand-ins: its output tensors (the tree's rest kept as ``out_spec``)."""
        outs, self.out_spec = flatten_outputs(subject.fn(*subject.static_inputs, params=leaves))
        return outs

    def build_outputs(self, outputs: Sequence[torch.Tensor]) -> Any:
        """The forward's output tree from replayed flat outputs."""
        if self._builder is None:
            self._builder = self.out_spec.builder()
        return self._builder(outputs)

    @abstractmethod
    def replay_forward(self) -> None:
        """Recompute static outputs and activations from the static inputs."""

    @abstractmethod
    def backward(
        self, grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], str | None]:
        """Gradients for every target from one gradient (or None) per differentiable output. Returns
        ``(gradients, how)``: ``how`` None for a replay (the gradients alias static buffers), else
        why it ran exactly through the recorded autograd graph (``"partial"``, ``"layout"``,
        ``"capture failed: ..."``), with fresh gradients. A target no gradient reaches gets None."""

    @abstractmethod
    def exact_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Fresh gradients computed eagerly through the recorded autograd graph, exactly as eager
        would. Touches no static buffer and leaves the activations as they are, so it can run again
        for the same forward (a retained graph, one ``autograd.grad`` per loss)."""

    def prepare_backward(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Called before each ``backward``; True when it captured new static gradient buffers."""
        return False

    @abstractmethod
    def free(self) -> None:
        """Release graphs and static memory; the recording is unusable afterwards."""


class Region(ABC):
    """One recorded body (a whole training step). ``capture`` runs it once and leaves its work done.
    What the body reads by reference (parameters, gradients, optimizer state) is read again at every
    replay."""

    @abstractmethod
    def capture(
        self, body: Callable[[], list[torch.Tensor]], host_feeds: Sequence[Spec] | None = None
    ) -> list[torch.Tensor]:
        """Record ``body`` and leave its work done; returns its (static) output tensors.
        ``host_feeds``: the host copies an eager run of the body made (:class:`.host_feeds.FeedSpecs`),
        copied again at each replay (the CPU backends copy host data at replay anyway)."""

    @abstractmethod
    def replay(self) -> None:
        """Run the recorded work again over the same tensors."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Clean up after a ``capture`` that raised (the device's capture state)."""

    def scratch(self) -> Scratch:
        """Where eager work before the capture runs: in the pool's free memory where the backend
        can (:mod:`replaykit.backends.scratch`); the base runs it beside the pool."""
        return Scratch()

    @abstractmethod
    def free(self) -> None:
        """Give back what the recording holds."""


class Backend(ABC):
    """Makes recordings and regions for one entry point; owns what they share (a CUDA memory pool)."""

    name: str

    @abstractmethod
    def record(self, subject: Subject) -> Recording:
        """Warm up ``subject.warmup`` times, then record ``subject.fn`` over its static inputs. The
        caller snapshots and restores module state and RNG around this call."""

    @abstractmethod
    def region(self, fixed: Sequence[torch.Tensor]) -> Region:
        """A new whole-step region; ``fixed`` are the static inputs the body reads (rewritten before each replay)."""

    def free(self) -> None:  # noqa: B027 - optional hook
        """Release what the recordings shared."""

    def pool_reserved(self) -> int | None:
        """Bytes its memory pool holds on the device (None: no pool, the emulated backend)."""
        return None

    def trim(self) -> None:  # noqa: B027 - optional hook
        """Give back cached memory no tensor uses (CUDA's caching allocator), before a recording grows its pool."""


def grad_targets(
    static_inputs: list[torch.Tensor], params: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The tensors a backward computes gradients for, in the order backends return them."""
    return [x for x in static_inputs if x.requires_grad] + list(params)


def differentiable_indices(outputs: list[torch.Tensor]) -> tuple[int, ...]:
    """Indices of the outputs that carry a gradient."""
    return tuple(i for i, o in enumerate(outputs) if o.requires_grad)


#: CUDA capture errors whose cause a user can act on: what the journal says instead of the code
_ACTIONABLE = {
    "cudaErrorStreamCaptureImplicit": (
        "the backward had to make the default CUDA stream wait on the capture: a parameter's "
        "gradient accumulator was made on that stream and is still held, by an autograd graph "
        "the caller keeps (an eager loss not yet freed: `del loss`, or keep `loss.detach()`) or "
        "by DistributedDataParallel built there (build it on a side stream)"
    ),
}


def known_cause(exc: BaseException) -> str | None:
    """What to do about a failed capture whose cause is known (no retry helps then), or None."""
    text = str(exc)
    for code, why in _ACTIONABLE.items():
        if code in text:
            return f"{why} ({code})"
    return None


def capture_failure(exc: BaseException) -> str:
    """The reason a failed capture retires with: what to do where the cause is known."""
    why = known_cause(exc)
    return f"capture failed: {why if why is not None else f'{type(exc).__name__}: {exc}'}"
