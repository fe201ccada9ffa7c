"""Draws from Python's ``random`` or numpy's global RNG that only choose: keyed, drawn before a replay.

LayerDrop and stochastic depth decide with ``random.random() < p`` in forward; task sampling
in a loss with ``random.random() < 0.5``. A graph freezes the branch its recording took, and
a replay does not advance the generator. But when each drawn value is only compared with a
number, the branch is a function of the draws: the step draws them itself before choosing a
recording (from the generator's state, as eager's forward would), keys the recording by the
comparisons' results, and after a replay leaves the generator where eager's draws leave it.

:class:`Watch` learns what the body does with its draws: while it runs, ``random.random()``,
``np.random.random()`` and ``np.random.rand()`` (no arguments) hand out :class:`Drawn` floats
that note each comparison; any other use of one (arithmetic, formatting, a conversion) marks
the run's draws as *escaped*: not a choice, not keyed (the entry point says why and runs the
call as before). A drawn value handed to a torch op is read by C++ without Python seeing it:
the capture's draws are therefore *moved* within the interval their comparisons allow, so the
recording's verification against the eager reference shows such a use as a difference.
"""

from __future__ import annotations

import math
import operator
import random
import sys
from collections.abc import Callable
from typing import Any

from ..verify.snapshot import host_rng_state, set_host_rng_state

__all__ = ["Drawn", "HostChoices", "Watch"]

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


_plain = float.__float__  # a Drawn's value as a plain float, unnoticed


class Drawn(float):
    """A drawn value: comparisons with a number are noted, any other use escapes."""

    _watch: Watch | None = None  # set by the Watch that hands them out
    _index = 0

    def _compare(self, op: str, other: Any) -> bool:
        result = _OPS[op](_plain(self), other)
        w = self._watch
        if w is not None:
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                w.uses[self._index].append((op, float(other)))
            else:
                w.escaped = True
        return result

    def __lt__(self, other: Any) -> bool:
        return self._compare("lt", other)

    def __le__(self, other: Any) -> bool:
        return self._compare("le", other)

    def __gt__(self, other: Any) -> bool:
        return self._compare("gt", other)

    def __ge__(self, other: Any) -> bool:
        return self._compare("ge", other)

    def __hash__(self) -> int:
        return float.__hash__(_plain(self))


def _escape(name: str) -> Callable[..., Any]:
    def used(self: Drawn, *args: Any) -> Any:
        if self._watch is not None:
            self._watch.escaped = True
        return getattr(float, name)(_plain(self), *args)

    return used


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__rpow__", "__neg__", "__pos__", "__abs__", "__float__", "__int__", "__round__",
    "__trunc__", "__floor__", "__ceil__", "__format__", "__repr__", "__str__", "__eq__",
    "__ne__", "__bool__", "__divmod__", "__rdivmod__",
):  # fmt: skip
    setattr(Drawn, _name, _escape(_name))


_PY, _NP = "random", "numpy"
_MISSING = object()


def _sources() -> list[tuple[Any, str, str]]:
    """The draw functions watched, with their generator: Python's module-level ``random`` (and
    its instance's method, which ``uniform`` and ``choice`` call), numpy's global ones where
    numpy is imported."""
    found = [(random, "random", _PY), (random._inst, "random", _PY)]
    np = sys.modules.get("numpy")
    if np is not None:
        found += [(np.random, n, _NP) for n in ("random", "rand", "random_sample")]
    return found


def _get_state(source: str) -> Any:
    return random.getstate() if source == _PY else sys.modules["numpy"].random.get_state()


def _set_state(source: str, state: Any) -> None:
    if source == _PY:
        random.setstate(state)
    else:
        sys.modules["numpy"].random.set_state(state)


def _draw(source: str) -> float:
    """One value from that generator, as the watched functions draw it."""
    if source == _PY:
        return random.random()
    return float(sys.modules["numpy"].random.random())


class Watch:
    """One run of the body with the host draws handed out as :class:`Drawn` (a context manager).

    ``moved``: per draw, the value to hand out instead of the real one (the capture's, see the
    module docstring); the generator still advances as eager's does. After the run, ``uses``
    holds each draw's comparisons, ``escaped`` whether a value was used otherwise."""

    def __init__(self, moved: list[float] | None = None) -> None:
        self.uses: list[list[tuple[str, float]]] = []
        self.sources: list[str] = []
        self.escaped = False
        self._moved = moved
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, fn: Callable[..., Any], source: str) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            value = fn(*args, **kwargs)
            if args or kwargs or not isinstance(value, float):
                self.escaped = True  # an array, a range: not a choice this watch can key
                return value
            i = len(self.uses)
            self.uses.append([])
            self.sources.append(source)
            if self._moved is not None and i < len(self._moved):
                value = self._moved[i]
            out = Drawn(value)
            out._index = i
            return out

        return draw

    def __enter__(self) -> Watch:
        Drawn._watch = self
        self._saved = []
        for owner, name, source in _sources():
            fn = getattr(owner, name, None)
            if fn is None:
                continue
            self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, self._wrap(fn, source))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            if fn is _MISSING:
                delattr(owner, name)  # an instance attribute shadowing the class's method
            else:
                setattr(owner, name, fn)
        Drawn._watch = None

    def program(self) -> tuple | None:
        """What the run did with its draws, as a key's program (per draw its comparisons), or None:
        no draws, or one escaped or unused (its value may have mattered elsewhere)."""
        if self.escaped or not self.uses or any(not u for u in self.uses):
            return None
        return tuple((s, tuple(u)) for s, u in zip(self.sources, self.uses, strict=True))


def _results(program: tuple, values: list[float]) -> tuple[bool, ...]:
    return tuple(
        _OPS[op](v, t) for (_, uses), v in zip(program, values, strict=True) for op, t in uses
    )


def _moved(program: tuple, values: list[float]) -> list[float]:
    """Per draw, another value its comparisons answer alike (the middle of the interval they allow)."""
    out = []
    for (_, uses), v in zip(program, values, strict=True):
        lo, hi = 0.0, 1.0
        for _, t in uses:
            if t <= v:
                lo = max(lo, t)
            if t > v:
                hi = min(hi, t)
        mid = (lo + hi) / 2
        if mid == v or not all(_OPS[op](mid, t) == _OPS[op](v, t) for op, t in uses):
            mid = math.nextafter(v, hi if hi > v else lo)
        out.append(mid if all(_OPS[op](mid, t) == _OPS[op](v, t) for op, t in uses) else v)
    return out


class HostChoices:
    """Per recording key: the host draws learnt, drawn before choosing a recording and keyed by
    the comparisons' results (``keyed=False``, the protection off: drawn, not keyed)."""

    def __init__(self, keyed: bool = True) -> None:
        self._keyed = keyed
        self._programs: dict[tuple, tuple] = {}
        self._base: tuple = ()
        self._values: list[float] = []
        self._start: list[tuple[str, Any]] | None = None  # the generators before this key's draws
        self.drawn_to: tuple | None = None  # the host RNG state after this key's draws

    def key(self, base: tuple) -> tuple:
        """``base``, and for a key whose draws were learnt, the choices this call's draws make.
        The generators are left where the draws leave them (a replay's call is done with them);
        a call that does not replay :meth:`rewind` s them first."""
        if not self._programs:  # nothing learnt: nothing drawn (the replay path of most models)
            self._base = base
            return base
        self._base, self.drawn_to, self._values, self._start = base, None, [], None
        program = self._programs.get(base)
        if program is None:
            return base
        self._start = [(s, _get_state(s)) for s in sorted({s for s, _ in program})]
        self._values = [_draw(source) for source, _ in program]
        return (*base, _results(program, self._values) if self._keyed else "drawn")

    def rewind(self) -> None:
        """The call does not replay (it records or runs eagerly): the generators back where the
        call found them, for its body to draw; ``drawn_to`` says where that body must leave them."""
        if self._start is None:
            return
        self.drawn_to = host_rng_state()
        for source, state in self._start:
            _set_state(source, state)
        self._start = None

    def advance(self) -> None:
        """After a replay: the host RNG where eager's draws would have left it (already there,
        unless the call was rewound for a check)."""
        if self._start is not None:
            self._start = None
        elif self.drawn_to is not None:
            set_host_rng_state(self.drawn_to)

    def rekey(self, key: tuple) -> tuple:
        """``key`` (a base another guard settled anew after :meth:`key`) with this call's choices,
        as :meth:`key` appended them to the old base."""
        program = self._programs.get(self._base)
        if program is None or not self._values:
            return key
        return (*key, _results(program, self._values) if self._keyed else "drawn")

    def watch(self, capture: bool = False) -> Watch:
        """A watch for a run of this call's body (``capture``: its draws moved)."""
        program = self._programs.get(self._base)
        if capture and program is not None and self._values:
            return Watch(_moved(program, self._values))
        return Watch()

    def watched(self, fn: Callable[..., Any], runs: list[Watch]) -> Callable[..., Any]:
        """``fn`` with each run under a capture's watch of its own (a recording's warm-up runs and
        its capture each draw afresh), appended to ``runs``."""

        def run(*args: Any, **kwargs: Any) -> Any:
            watch = self.watch(capture=True)
            runs.append(watch)
            with watch:
                return fn(*args, **kwargs)

        return run

    def learn(self, watch: Watch) -> bool:
        """A run's draws that only chose (none learnt for this key yet): keyed from the next call."""
        program = watch.program()
        if program is None or self._base in self._programs:
            return False
        self._programs[self._base] = program
        return True

    def learnt(self, watch: Watch | None) -> str | None:
        """A run whose only effect was drawing from Python's or numpy's RNG: what is learnt when its
        draws only chose (keyed from the next call), or None (the draw stays a reason)."""
        if watch is None or not self.learn(watch):
            return None
        return (
            f"{len(watch.uses)} host draw(s) that only choose: drawn and keyed from the next call"
        )

    def matches(self, watch: Watch) -> bool:
        """Whether a run made exactly the draws and comparisons this key learnt (none if none)."""
        program = self._programs.get(self._base)
        if program is None:
            return not watch.uses
        return watch.program() == program

    def changed(self, who: str, *runs: Watch | None) -> str | None:
        """Why no replay of this key would make the runs' draws (another count, another comparison,
        a value used otherwise), or None: each run made exactly those its key learnt."""
        if all(w is None or self.matches(w) for w in runs):
            return None
        return (
            f"{who}'s draws from Python's random or numpy differ from those its recording key learnt "
            "(their number or comparisons), or a drawn value is used otherwise than compared"
        )
