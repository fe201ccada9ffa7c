"""The protections that make replay equal eager, and the diagnostic switch that turns them off."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from .errors import ReplayError, ReplayWarning

#: Every protection, by the name ``unsafe_disable`` takes.
PROTECTIONS: tuple[str, ...] = (
    "copy_out", "hold", "live_outputs", "none_pattern",  # static buffers and the pending backward
    "module_state", "param_identity", "argument_values", "input_aliasing", "input_layout",  # guards
    "record_probe", "repeat_backward", "inplace_weights",
)

_WHAT = {
    "copy_out": "live gradients are not copied out before a replay: accumulation reads overwritten buffers",
    "hold": "forwards replay while a backward is pending: it reads the later forward's activations",
    "live_outputs": "outputs the caller still holds are overwritten by the next replay",
    "none_pattern": "parameters behind unread outputs get zero gradients where eager leaves None",
    "module_state": "submodules' training flags and attributes are not guarded: a changed value replays the old one",
    "param_identity": "parameters swapped (functional_call) or registered anew (parametrize) replay the recorded ones",
    "argument_values": "non-tensor arguments are keyed by ==: -0.0 replays 0.0, objects are frozen",
    "input_aliasing": "the same tensor passed twice replays a recording made for distinct tensors",
    "input_layout": "static inputs are contiguous copies: strided or expanded inputs change reduction order",
    "record_probe": "side effects, in-place input writes, private generators and sparse gradients are not looked for",
    "repeat_backward": "a second backward through one replayed call rewrites the first one's gradient buffers; create_graph gets no graph",
    "inplace_weights": "parameters changed in place between a replayed forward and its backward go unnoticed",
}


def disabled_protections(names: Iterable[str] | str) -> frozenset[str]:
    """Validate ``unsafe_disable`` and warn once per protection switched off."""
    if isinstance(names, str):
        names = (names,)
    chosen = frozenset(names)
    unknown = sorted(chosen - set(PROTECTIONS))
    if unknown:
        raise ReplayError(f"unknown unsafe_disable name(s) {unknown}; choose from {list(PROTECTIONS)}")
    for name in sorted(chosen):
        warnings.warn(
            f"replaykit: protection {name!r} is disabled ({_WHAT[name]}); results may differ from eager",
            ReplayWarning,
            stacklevel=3,
        )
    return chosen
