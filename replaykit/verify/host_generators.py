"""Private host generators a recording call reaches: ``random.Random`` and numpy's ``Generator`` and
``RandomState`` objects that are not the global ones.

An MAE masks with ``self.rng = np.random.default_rng(7)``; a loss samples its task with a
closure's ``random.Random(0)``. The recording call runs the step's Python more than once (probe,
eager reference, capture): each run draws from such a generator, and a draw on the host is no
aten op, so neither a graph nor the tape sees it and a replay would repeat the first. They are
found once, at the recording call, where the call state looks (:class:`HostGenerators`): what
the model's modules hold (an attribute, a container, a plain object they hold, as for torch's
generators), what loss_fn's code holds (closure cells, defaults, the globals it names, a bound
method's object) and the globals and closure cells a ``forward`` names. Their states are taken
and put back with the call state, and a run that moved one drew what no replay draws: the entry
point runs that call eagerly and retires, saying which generator. Python's and numpy's global
generators are the snapshots' (:func:`~replaykit.verify.snapshot.host_rng_state`).

Not reached: a generator held deeper than the walks go (four containers or objects down), or
behind a library's object (a torch or numpy object the walk does not enter).
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterable, Sequence
from types import FunctionType
from typing import Any

from torch import nn

from ..guards.keys import cell_filled, is_ndarray
from ..guards.module import code_names

__all__ = ["HostGenerators", "forward_named", "is_host_generator"]


def is_host_generator(value: Any) -> bool:
    """A private ``random.Random`` or numpy ``Generator`` / ``RandomState`` (not the global ones,
    nor one without a state to take: ``random.SystemRandom``)."""
    if isinstance(value, random.Random):
        return value is not random._inst and not isinstance(value, random.SystemRandom)  # type: ignore[attr-defined]
    np = sys.modules.get("numpy")
    if np is None or type(value).__module__.partition(".")[0] != "numpy":
        return False
    if isinstance(value, np.random.RandomState):
        return value is not np.random.mtrand._rand
    return isinstance(value, np.random.Generator)


def state_of(g: Any) -> Any:
    """``g``'s state, a copy that later draws do not change."""
    if isinstance(g, random.Random):
        return g.getstate()
    if hasattr(g, "get_state"):  # RandomState
        return copy.deepcopy(g.get_state(legacy=False))
    return copy.deepcopy(g.bit_generator.state)


def set_state(g: Any, state: Any) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
    elif hasattr(g, "set_state"):
        g.set_state(copy.deepcopy(state))
    else:
        g.bit_generator.state = copy.deepcopy(state)


def _comparable(state: Any) -> Any:
    """A state with its arrays as bytes (MT19937's key), so that ``==`` compares it."""
    if isinstance(state, dict):
        return tuple((k, _comparable(v)) for k, v in state.items())
    if isinstance(state, (tuple, list)):
        return tuple(_comparable(v) for v in state)
    if is_ndarray(state):
        return (state.dtype.str, state.shape, state.tobytes())
    return state


def forward_named(modules: Iterable[nn.Module]) -> list[Any]:
    """The values the ``forward`` of each user class among ``modules`` names through a global or a
    closure cell (one level: the forward's own code), where a private generator may live."""
    found: list[Any] = []
    seen: set[type] = set()
    for m in modules:
        cls = type(m)
        if cls in seen or cls.__module__.startswith("torch."):
            continue
        seen.add(cls)
        fn = vars(cls).get("forward")
        if not isinstance(fn, FunctionType):
            continue
        found += [c.cell_contents for c in fn.__closure__ or () if cell_filled(c)]
        names = code_names(fn.__code__)
        found += [v for k, v in fn.__globals__.items() if k in names]
    return found


class HostGenerators:
    """The private host generators a recording call reaches, with their states when it began:
    :meth:`restore` puts them back, :meth:`drawn` names one a run moved. ``owners``: who holds
    each ("the model"), for the reason; ``modules``: the model's named modules, where one held as
    an attribute is named (``MaskedAE.rng``) when a reason is given."""

    def __init__(
        self,
        generators: Iterable[Any],
        owners: dict[int, str] | None = None,
        modules: Sequence[tuple[str, nn.Module]] = (),
    ) -> None:
        unique: dict[int, Any] = {}
        for g in generators:
            unique.setdefault(id(g), g)
        self._states = [(g, state_of(g)) for g in unique.values()]
        self._owners = owners or {}
        self._modules = modules if self._states else ()

    def __bool__(self) -> bool:
        return bool(self._states)

    def restore(self) -> None:
        for g, state in self._states:
            set_state(g, state)

    def drawn(self, who: str) -> str | None:
        """Why no replay would repeat the runs since the call began (or since :meth:`restore`):
        one of the generators moved, or None."""
        moved = next(
            (g for g, state in self._states if _comparable(state_of(g)) != _comparable(state)),
            None,
        )
        if moved is None:
            return None
        return (
            f"{who} draws from {self._held(moved)}, a private host generator; a replay would "
            "repeat the first draw. What you can change: draw on the device from a "
            "torch.Generator the module holds (rk.capture replays those), or draw outside the "
            "step and pass the result in"
        )

    def _held(self, g: Any) -> str:
        """``MaskedAE.rng (random.Random)``, or ``a random.Random the model holds``."""
        cls = type(g)
        root = cls.__module__.partition(".")[0]
        kind = (
            f"numpy.random.{cls.__name__}"
            if root == "numpy"
            else f"{cls.__module__}.{cls.__qualname__}"
        )
        for name, m in self._modules:
            attr = next((k for k, v in m.__dict__.items() if v is g), None)
            if attr is not None:
                return f"{name or type(m).__name__}.{attr} ({kind})"
        return f"a {kind} {self._owners.get(id(g), 'the model or its code')} holds"
