"""The one exception replaykit raises, the warning it gives when an entry point retires, and argument checks."""

from __future__ import annotations


class ReplayError(RuntimeError):
    """Misuse of the API, or (with ``strict=True``) any eager route or retirement, with its reason."""


class ReplayWarning(UserWarning):
    """A recorder retired to eager, or a protection was switched off."""


def check_count(name: str, value: object, least: int, note: str = "") -> None:
    """Refuse an argument that is not an int >= ``least`` (a bool is no count), naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ReplayError(
            f"{name} must be an int >= {least}{' ' + note if note else ''}, got {value!r}"
        )


def check_loss(loss: object) -> object:
    """``loss_fn``'s result, which a whole step differentiates: a tuple or a dict (``loss, logits``,
    a ModelOutput-like ``{"loss": ...}``) is said plainly, not as ``'tuple' object has no attribute
    'backward'`` from inside the step."""
    if hasattr(loss, "backward") and hasattr(loss, "detach"):  # a tensor (errors imports no torch)
        return loss
    raise ReplayError(
        f"loss_fn must return the loss as a tensor; it returned a {type(loss).__name__}. Return the "
        "loss alone (e.g. `return out.loss` or `return losses['loss']`); compute what else you log "
        "outside the step"
    )
