"""``rk.capture``: put a module's calls on a recorder's route, and the registry of captured modules.

Kept apart from :mod:`replaykit.recorder` (what a recorder does with a call) because this is what
decides whether a module may be captured at all: validated settings, a module not captured
twice, not inside or around another captured module (two recorders would share one call).
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.parameter import is_lazy

from .backends import resolve_backend
from .errors import ReplayError, check_count
from .guards.compiled import refuse_cudagraphs
from .guards.module import tree_contains
from .memory.pool import MemoryPool, check_pool
from .protections import disabled_protections
from .recorder import RECORDER_ATTR, Recorder

__all__ = ["capture", "recorder_of"]


def recorder_of(module: nn.Module) -> Recorder | None:
    """The live recorder of a captured module, or None."""
    return module.__dict__.get(RECORDER_ATTR)


def capture(
    module: nn.Module,
    *,
    backend: str = "auto",
    warmup: int = 3,
    max_recordings: int = 8,
    strict: bool = False,
    check_every: int = 0,
    multi_backward: bool = False,
    max_rerecords: int = 8,
    unsafe_disable: tuple[str, ...] | list[str] | str = (),
    pool: MemoryPool | None = None,
) -> Recorder:
    """Route every call of ``module`` through a recorder: record, replay, or eager with a reason. A
    call records its signature and the module tree's host state (while ``max_recordings`` lasts),
    then replays; what a replay could not repeat exactly runs eagerly with the reason in the
    journal, retires the recorder, or raises :class:`ReplayError`, never a wrong number. Every route
    and setting: docs/reference.md (``rk.capture``)."""
    _refuse(module, warmup, max_recordings, max_rerecords, check_every)
    disabled = disabled_protections(unsafe_disable, "capture")
    pool = check_pool(pool)
    chosen = resolve_backend(backend, module, pool)
    recorder = Recorder(
        module,
        chosen,
        warmup,
        max_recordings,
        bool(strict),
        disabled,
        check_every,
        bool(multi_backward),
        max_rerecords,
        pool,
    )
    _live[id(recorder)] = weakref.ref(recorder)
    weakref.finalize(recorder, _live.pop, id(recorder), None)
    return recorder


def _refuse(
    module: nn.Module, warmup: int, max_recordings: int, max_rerecords: int, check_every: int
) -> None:
    """What may not be captured, or not with these settings: raise :class:`ReplayError`."""
    if not isinstance(module, nn.Module):
        raise ReplayError(f"capture() takes an nn.Module, not {type(module).__name__}")
    check_count("warmup", warmup, 1)
    check_count("max_recordings", max_recordings, 1)
    check_count("max_rerecords", max_rerecords, 0)
    check_count("check_every", check_every, 0, "(0: off)")
    if recorder_of(module) is not None:
        raise ReplayError(
            f"{type(module).__name__} is already captured; call release() on its recorder first"
        )
    if getattr(module.forward, "__func__", None) is nn.Module.forward:
        # a container (ModuleDict, ModuleList, an actor-critic holding ``pi`` and ``v``): the loop
        # calls its children, so nothing would ever be recorded, and nothing said
        children = ", ".join(name for name, _ in list(module.named_children())[:3]) or "none"
        raise ReplayError(
            f"{type(module).__name__} has no forward of its own, so a loop never calls it: capture "
            f"the modules it calls (its children: {children}), or use rk.TrainStep, whose loss_fn "
            "may call any of them"
        )
    _refuse_nesting(module)
    refuse_cudagraphs(module, "capture")
    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        raise ReplayError(
            f"{type(module).__name__} has uninitialized (lazy) parameters or buffers ({lazy[0]}, ...): "
            "run one forward eagerly to materialize them, then capture"
        )


#: Live recorders, weakly: to refuse capturing a module inside or around a captured one.
_live: dict[int, weakref.ref[Recorder]] = {}


def _refuse_nesting(module: nn.Module) -> None:
    """A captured module's forward runs inside the other's recording: two recorders would share one call."""
    for m in module.modules():
        if m is not module and recorder_of(m) is not None:
            raise ReplayError(
                f"{type(m).__name__} inside {type(module).__name__} is captured already; release it first"
            )
    for ref in list(_live.values()):
        other = ref()
        if (
            other is not None
            and other.module is not None
            and not other.released
            and tree_contains(other.module, module)
        ):
            raise ReplayError(
                f"{type(module).__name__} is inside {other.module_name}, which is captured; release that recorder first"
            )
