"""Contexts entered around every recording: libraries told, while a graph is captured, what eager sees.

Some libraries branch on ``is_current_stream_capturing()`` (transformers' mask builders then skip
a host read), so each integration (``replaykit.integrations.<library>``) registers a context that
makes its library take eager's branch during a recording; that branch's host read is answered
from the key (:mod:`replaykit.guards.input_reads`). The core never imports a library: an
integration loads at the first recording that finds its library in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

#: library (its import name) -> the integration module that registers its context
INTEGRATIONS: dict[str, str] = {"transformers": "replaykit.integrations.transformers"}
_CONTEXTS: dict[str, Callable[[], AbstractContextManager]] = {}


def register(name: str, factory: Callable[[], AbstractContextManager]) -> None:
    """An integration's context, entered around every recording from now on."""
    _CONTEXTS[name] = factory


def unregister(name: str) -> None:
    """Stop entering ``name``'s context (a test's, once it is done)."""
    _CONTEXTS.pop(name, None)


@contextmanager
def recording(enabled: bool = True) -> Iterator[None]:
    """Around one recording (its warm-up and capture): every registered integration's context."""
    if not enabled:
        yield
        return
    for library, module in INTEGRATIONS.items():
        if library in sys.modules and library not in _CONTEXTS:
            importlib.import_module(module)  # registers itself
    with ExitStack() as stack:
        for factory in list(_CONTEXTS.values()):
            stack.enter_context(factory())
        yield
