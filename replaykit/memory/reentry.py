"""Reentry: a captured module called again before the previous call's backward.

Eager shares work between two such calls that no recording can: a parameter read twice gets its
gradient summed in another order, and autocast casts each parameter once per region. Which
recordings are at risk is known when they are made; whether the code calls twice is not. So an
at-risk recording's first call runs eagerly and is watched (:class:`FirstUse`): another call
before its backward refuses the signature (exact: every call was eager); its backward first
clears it to replay. A later reentry of a replayed call is seen by the hold and warned about.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_KEY = "replaykit_first_use"


class _Token:
    """Kept alive by the watched call's autograd node; dies with that graph."""

    __slots__ = ("__weakref__",)


class FirstUse:
    """At most one watched eager call per recorder: ``begin`` after it, ``take`` at the next call."""

    def __init__(self) -> None:
        self._token: weakref.ref[_Token] | None = None
        self._cleared: Callable[[], None] | None = None
        self._subject: Any = None

    @property
    def pending(self) -> bool:
        """A watched call's backward has not run, and its graph is alive."""
        return self._token is not None

    def begin(self, outputs: Any, subject: Any, cleared: Callable[[], None]) -> bool:
        """Watch the call that returned ``outputs``; ``cleared()`` runs when its backward starts.
        False when nothing of it can be differentiated (nothing to watch: cleared at once)."""
        node = next(
            (
                t.grad_fn
                for t in tree_leaves(outputs)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None
            ),
            None,
        )
        if node is None:
            cleared()
            return False
        token = _Token()
        node.metadata[_KEY] = token
        me = weakref.ref(self)
        node.register_prehook(lambda grads: (w := me()) is not None and w._ran(token))
        self._token = weakref.ref(token, self._dropped)
        self._subject, self._cleared = subject, cleared
        return True

    def take(self) -> Any:
        """A call arrived while one is watched: the watched call's subject, and the watch ends."""
        subject = self._subject
        self.clear()
        return subject

    def clear(self) -> None:
        self._token, self._cleared, self._subject = None, None, None

    def _ran(self, token: _Token) -> None:
        if self._token is not None and self._token() is token:
            cleared = self._cleared
            self.clear()
            if cleared is not None:
                cleared()

    def _dropped(self, ref: weakref.ref) -> None:
        if self._token is ref:  # no backward: watch the next call of the recording instead
            self.clear()
