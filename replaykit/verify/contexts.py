"""Contexts entered around every recording: libraries told, while a graph is captured, what eager sees.

Some libraries branch on ``torch.cuda.is_current_stream_capturing()``: Hugging Face
transformers' ``is_tracing()`` is true under a capture, and its attention-mask builders then
skip a host read and build the mask another way than eager does. A recording must compute
what eager computes, so each integration (``replaykit.integrations.<library>``) registers a
context that, during a recording only, makes its library take eager's branch; the host read
that branch makes is answered from the recording's key (:mod:`replaykit.guards.input_reads`).

The core never imports a library: an integration is loaded when its library is already
imported (``sys.modules``), at the first recording that finds it there.
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
