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
    """Route every call of ``module`` through a recorder: record, replay, or eager with a reason.

    - A call in training mode with grad enabled and no replay backward pending records
      its signature (shapes, dtypes, strides, devices, requires_grad, non-tensor
      arguments, autocast state) while ``max_recordings`` lasts, then replays it.
    - Host-side values the forward reads are guarded (:mod:`replaykit.guards.module`): every
      submodule's ``training`` flag and plain attributes (``dropout.p``, ``momentum``, a
      float schedule) are part of the key, so a change records anew; parameters swapped
      for other tensors (``torch.func.functional_call``) route eager.
    - Otherwise it runs eagerly, with the reason in the journal: ``no_grad``, ``eval``,
      ``hold``, ``budget``, ``unhashable_argument``, ``object_argument``,
      ``parameters_swapped``, ``input_reused``, ``thread``, ``paused``, ``retired``.
    - Replays end bitwise equal to eager training: live gradients and outputs are
      copied out before each replay, the hold keeps a pending backward's activations,
      and parameters behind unread outputs keep ``.grad is None``.
    - A parameter, buffer or submodule registered anew, storage changed (``.to()``,
      ``load_state_dict(..., assign=True)``) or a frozen layer unfrozen drops the
      recordings and records anew (``rerecord`` in the journal, at most ``max_rerecords``
      times). New submodule hooks, a forward with side effects a replay cannot repeat
      (:mod:`replaykit.verify.probe`) or a failing capture retire the recorder (permanent eager,
      graphs freed, one warning).
    - What cannot be replayed exactly raises :class:`ReplayError` rather than give a
      wrong number: ``create_graph=True`` through a replayed call, a second backward
      through a call whose first backward replayed the graph (pass
      ``multi_backward=True`` to run every backward exactly through the recorded graph).

    ``backend`` is ``"cuda"``, ``"emulated"`` or ``"auto"`` (cuda for a module on a CUDA
    device). ``strict=True`` raises :class:`ReplayError` instead of any eager route or
    retirement. ``check_every=N`` compares every N-th replayed call with eager on the
    same state and retires with reason ``diverged: ...`` on any difference
    (:mod:`replaykit.verify.shadow`). ``pool=rk.MemoryPool()`` records into a pool shared with other
    entry points (:mod:`replaykit.memory.pool`; a call while another holds live memory there runs
    eagerly, ``pool_busy``). ``unsafe_disable`` switches protections off, for
    diagnosis only. Capturing a module that is already captured, or one inside (or
    around) a captured module, raises :class:`ReplayError`.

    Over 60 lines for this docstring alone (the routes' reference, what ``help(rk.capture)``
    shows); the code below is a few lines.
    """
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
