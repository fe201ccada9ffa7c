"""The one exception replaykit raises, and the warning it gives when a recorder retires."""

from __future__ import annotations


class ReplayError(RuntimeError):
    """Misuse of the API, or (with ``strict=True``) any eager route or retirement, with its reason."""


class ReplayWarning(UserWarning):
    """A recorder retired to eager, or a protection was switched off."""
