"""Gradients a whole step gives a second network: leaves outside the model that ``loss_fn`` reaches.

A GAN's generator loss runs a trainable discriminator, a distillation loss a teacher that is
trained too: eager's backward accumulates into their ``.grad`` as well (in place into a
gradient already there, a new tensor where it was None). The step's recording call finds them
(the eager reference's graph reaches leaves requiring grad outside the model and the
optimizer) and records them from then on as the model's own: each recording reads their
incoming gradients from static buffers (copied in before a replay) and hands the result back
as eager does, into the caller's gradient tensor or as a new one. Only leaves owned by a
module ``loss_fn`` holds are taken, found by name: each call checks the owner still holds the
same tensor (a discriminator whose weight was replaced keys anew), which a bare tensor could
not tell.

A leaf's gradient accumulator is made once and kept while any autograd graph holds it: a GAN
loop's discriminator loss, still alive at the generator step, holds the one its eager step made on
the default stream, and a captured backward through it would wait on that stream, which a CUDA
capture refuses. :meth:`ForeignLeaves.standing_in` puts a new leaf on the same memory in each
leaf's place for the capture, whose accumulator is made inside it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["ForeignBuffers", "ForeignLeaves"]


def _layout(g: torch.Tensor | None) -> tuple | None:
    return None if g is None else (g.dtype, g.device, tuple(g.shape), g.stride())


def _module_at(top: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    m: nn.Module | None = top
    for name in path:
        m = m.__dict__["_modules"].get(name)
        if m is None:
            return None
    return m


def _owned(top: nn.Module, path: tuple[str, ...]) -> torch.Tensor | None:
    """The parameter ``top`` holds under that dotted path now (a layer replaced holds another):
    read from the modules' own dicts, as ``get_parameter`` does, without its checks (per call)."""
    m = _module_at(top, path[:-1])
    return None if m is None else m.__dict__["_parameters"].get(path[-1])


class ForeignLeaves:
    """The leaves outside the model a step's loss reached, each with the module (one loss_fn holds)
    and the dotted name it is held under."""

    __slots__ = ("_checked", "_owners", "leaves", "standing")

    def __init__(self, checked: bool = True) -> None:
        self._checked = checked  # protection foreign_owners: the owners are asked per call
        self.leaves: list[torch.Tensor] = []
        self._owners: list[tuple[nn.Module, tuple[str, ...]]] = []
        self.standing: list[torch.Tensor] = []  # the stand-ins while standing_in() runs

    def known(self) -> list[torch.Tensor]:
        """The leaves, and their stand-ins while a capture runs: none of them is a new leaf."""
        return [*self.leaves, *self.standing]

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """Around a capture: each leaf's place in its owner taken by a new leaf on the same memory
        with the leaf's ``.grad``; after, the leaf is back with the ``.grad`` its stand-in was left.
        Left as it is: a leaf held under two names, in one owner or two (a tied weight: one
        stand-in would take half its gradient), with hooks (they stay on the leaf), a subclass of
        ``nn.Parameter``, or no longer its owner's."""
        places = []
        tops = {id(top): top for top, _ in self._owners}.values()
        names = Counter(id(q) for t in tops for _, q in t.named_parameters(remove_duplicate=False))
        for (top, path), p in zip(self._owners, self.leaves, strict=True):
            parent = _module_at(top, path[:-1])
            if (
                parent is None
                or parent.__dict__["_parameters"].get(path[-1]) is not p
                or type(p) is not nn.Parameter  # a subclass: its constructor is its own
                or p._backward_hooks
                or getattr(p, "_post_accumulate_grad_hooks", None)
                or names[id(p)] != 1
            ):
                continue
            stand_in = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            stand_in.__dict__.update(p.__dict__)  # attributes set on the weight (a gain) stay
            stand_in.grad = p.grad
            parent.__dict__["_parameters"][path[-1]] = stand_in
            places.append((parent, path[-1], p, stand_in))
        self.standing = [s for *_, s in places]
        try:
            yield
        finally:
            for parent, name, p, stand_in in places:
                parent.__dict__["_parameters"][name] = p
                p.grad = stand_in.grad
            self.standing = []

    def learn(self, found: Sequence[torch.Tensor], modules: Iterable[nn.Module]) -> bool:
        """Take ``found`` (leaves not known yet) if each is a parameter of one of ``modules``;
        False (nothing taken) otherwise."""
        names = {
            id(p): (top, tuple(n.split("."))) for top in modules for n, p in top.named_parameters()
        }
        if not found or any(id(t) not in names for t in found):
            return False
        self.leaves += found
        self._owners += [names[id(t)] for t in found]
        return True

    def key(self) -> tuple:
        """Per leaf: still its owner's, whether it requires grad, its memory (``p.data = ...``
        re-binds it: a recording reads the memory it was captured on), its gradient's None pattern
        and layout."""
        if not self.leaves:
            return ()
        return tuple(
            (
                not self._checked or _owned(m, n) is p,
                p.requires_grad,
                p.data_ptr(),
                p.dtype,
                _layout(p.grad),
            )
            for (m, n), p in zip(self._owners, self.leaves, strict=True)
        )


class ForeignBuffers:
    """One recording's static gradient buffers for the foreign leaves: ``ins`` (a copy of each
    incoming gradient the backward accumulates into) and ``outs`` (each leaf's ``.grad`` after)."""

    __slots__ = ("_held", "ins", "leaves", "outs")

    def __init__(self, leaves: Sequence[torch.Tensor]) -> None:
        self.leaves = list(leaves)
        self._held: list[torch.Tensor | None] = [p.grad for p in self.leaves]
        with torch.no_grad():
            self.ins = [None if g is None else g.detach().clone() for g in self._held]
        self.outs: list[torch.Tensor | None] = []

    def begin(self) -> None:
        """Before the capture: the static copies are the leaves' ``.grad``."""
        for p, b in zip(self.leaves, self.ins, strict=True):
            p.grad = b

    def captured(self) -> None:
        """After the capture (its work done: the emulated tape ran it, a CUDA graph replayed it
        once): what it left is kept, and handed out."""
        self.outs = [p.grad for p in self.leaves]
        self.hand_out()

    def copy_in(self) -> None:
        """Before a replay: the caller's current gradients into the static copies."""
        self._held = [p.grad for p in self.leaves]
        with torch.no_grad():
            for b, g in zip(self.ins, self._held, strict=True):
                if b is not None:
                    b.copy_(g)

    def hand_out(self) -> None:
        """The gradients as eager leaves them: accumulated into the caller's tensor where there was
        one (eager adds in place), a new tensor where it was None (a replay would overwrite ours)."""
        with torch.no_grad():
            for p, held, b, out in zip(self.leaves, self._held, self.ins, self.outs, strict=True):
                if out is None:
                    p.grad = None
                elif held is not None and out is b:
                    held.copy_(out)
                    p.grad = held
                else:
                    p.grad = out.clone()
        self._held = []

    def tensors(self) -> list[torch.Tensor]:
        """The static buffers (what another graph in a shared pool may overwrite)."""
        return [t for t in (*self.ins, *self.outs) if t is not None]
