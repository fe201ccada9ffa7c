"""The pending-backward hold.

Until a replayed forward's backward ran, a replay would overwrite the activations it needs, so
later forwards route eager (``hold``). The hold also ends when the pending graph is dropped
unused, so a forward nobody differentiates cannot leave the recorder eager for ever.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


class PendingBackward:
    """Token kept alive by the replayed call's autograd node; dies with that graph."""

    __slots__ = ("__weakref__", "call")

    def __init__(self, call: int) -> None:
        self.call = call


class Hold:
    """At most one pending backward per recorder; ``on_drop(call)`` hears a graph dropped without its backward."""

    def __init__(self, on_drop: Callable[[int], None]) -> None:
        self._pending: weakref.ref[PendingBackward] | None = None
        self._pending_call = -1
        self._on_drop = on_drop

    @property
    def active(self) -> bool:
        return self._pending is not None

    def begin(self, call: int) -> PendingBackward:
        """Start holding for ``call``; the caller stores the token where autograd keeps it alive."""
        token = PendingBackward(call)
        self._pending = weakref.ref(token, self._dropped)
        self._pending_call = call
        return token

    def release(self, token: PendingBackward) -> bool:
        """End the hold of ``token``: True when it was the pending one (the caller journals the end)."""
        pending = self._pending
        if pending is not None and pending() is token:
            self._pending = None
            return True
        return False

    def clear(self) -> None:
        """Forget any pending backward (retirement, release)."""
        self._pending = None

    def _dropped(self, ref: weakref.ref) -> None:
        if self._pending is ref:
            self._pending = None
            self._on_drop(self._pending_call)
