"""The protections that make replay equal eager: one registry, and the diagnostic switch that turns them off.

Each protection has a scope: the entry points it guards (``capture``, network replay;
``step``, the whole step; ``both``). ``unsafe_disable`` takes the names in its entry
point's scope, and every protection has a test whose unsafe arm diverges without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import NamedTuple

from .errors import ReplayError, ReplayWarning


class Protection(NamedTuple):
    """One protection: its ``unsafe_disable`` name, the entry points it guards, what goes wrong without it."""

    name: str
    scope: str  # "capture", "step", "optimizer_step" or "both"
    without: str


REGISTRY: dict[str, Protection] = {
    p.name: p
    for p in (
        # static buffers and the pending backward
        Protection(
            "copy_out",
            "both",
            "live gradients are not copied out before a replay: accumulation reads overwritten buffers",
        ),
        Protection(
            "write_back",
            "both",
            "an input the recorded code writes in place (a batch centred by forward or loss_fn) is not written "
            "back after a replay: the replay writes its static copy, the caller's tensor keeps its old values",
        ),
        Protection(
            "attribute_outputs",
            "both",
            "a tensor the forward assigns to a module attribute without reading the old one (an MoE "
            "aux_loss, attention kept for logging) is recorded as an output but not assigned after a "
            "replay: the attribute keeps an earlier call's tensor",
        ),
        Protection(
            "hold",
            "capture",
            "forwards replay while a backward is pending: it reads the later forward's activations",
        ),
        Protection(
            "live_outputs",
            "capture",
            "outputs the caller still holds are overwritten by the next replay",
        ),
        Protection(
            "reentry",
            "capture",
            "a call made while a replayed call's backward is pending, sharing work with it in eager (a weight read twice, autocast's cast cache), is not said: that step differs silently",
        ),
        Protection(
            "none_pattern",
            "capture",
            "parameters behind unread outputs get zero gradients where eager leaves None",
        ),
        # guards
        Protection(
            "module_state",
            "both",
            "submodules' training flags and attributes are not guarded: a changed value replays the old one",
        ),
        Protection(
            "param_identity",
            "both",
            "parameters swapped (functional_call) or registered anew (parametrize) replay the recorded ones; "
            "a whole step's optimizer steps a layer frozen between two micro-batches with its recorded gradient",
        ),
        Protection(
            "argument_values",
            "capture",
            "non-tensor arguments are keyed by ==: -0.0 replays 0.0, objects are frozen",
        ),
        Protection(
            "input_aliasing",
            "capture",
            "the same tensor passed twice replays a recording made for distinct tensors",
        ),
        Protection(
            "input_layout",
            "capture",
            "static inputs are contiguous copies: strided or expanded inputs change reduction order",
        ),
        Protection(
            "record_probe",
            "capture",
            "side effects, in-place input writes, private generators and sparse gradients are not looked for",
        ),
        Protection(
            "data_rebind",
            "capture",
            "a forward rebinding a parameter's or buffer's .data (MoCo's `pk.data = pk.data * m + ...`) is not "
            "looked for: the recording call's extra runs apply it again and a replay never does",
        ),
        Protection(
            "output_state",
            "capture",
            "an output that is (a view of) a parameter or buffer replays as memory of its own: a reference "
            "the caller keeps stops following the module's tensor",
        ),
        Protection(
            "hook_order",
            "capture",
            "gradient hooks run in the order the engine picks after a replayed backward, not as "
            "eager's backward reaches each parameter (a per-parameter optimizer stepping in "
            "backward, a hook reading another parameter's .grad)",
        ),
        Protection(
            "repeat_backward",
            "capture",
            "a second backward through one replayed call rewrites the first one's gradient buffers; create_graph gets no graph",
        ),
        Protection(
            "inplace_weights",
            "capture",
            "parameters changed in place between a replayed forward and its backward go unnoticed",
        ),
        Protection(
            "verify_recording",
            "both",
            "a new recording is trusted unchecked: code that computes differently under capture (a library branching on it) replays that",
        ),
        Protection(
            "call_state",
            "both",
            "a recording call's extra runs (probe, eager reference, capture, a retry) are put back only as far as the "
            "model's tensors: a buffer re-bound in forward, modules and values loss_fn holds, the optimizer's "
            "param-group values, a private random.Random or numpy Generator move two or three times in one call, "
            "and each run prints",
        ),
        Protection(
            "autograd_modes",
            "both",
            "calls under anomaly mode, saved-tensor hooks, torch.func transforms or inside a backward (checkpoint's recompute) replay as if none were on",
        ),
        Protection(
            "host_rng",
            "both",
            "a recorded call that drew from Python's or numpy's RNG, a private random.Random or numpy Generator the model "
            "or loss_fn holds, or torch's CPU generator beside a GPU model, replays the first draw for ever",
        ),
        Protection(
            "forward_inputs",
            "both",
            "a class attribute or a module-level value (a tensor by identity) the model's forward reads is frozen at "
            "recording, and a global container it changes changes once then never again (TrainStep)",
        ),
        Protection(
            "output_constants",
            "capture",
            "what a forward returns besides tensors (None, numbers, a ModelOutput's fields) is taken from the recording unchecked: a value computed differently under capture replays that",
        ),
        Protection(
            "input_versions",
            "capture",
            "an input changed in place between a replayed forward and its backward goes unnoticed (eager raises)",
        ),
        Protection(
            "input_rewrites",
            "capture",
            "an input the backward reads, rewritten between a replayed forward and its backward without a version "
            "bump (a numpy buffer a loader refills, a write through .data), is read as the forward copied it: "
            "eager's backward reads the new values",
        ),
        Protection(
            "shared_pool",
            "both",
            "entry points sharing a MemoryPool replay while another holds live static memory there: its outputs or gradients are overwritten",
        ),
        Protection(
            "input_reads",
            "both",
            "host reads of values computed from the inputs alone (a padding mask's .all()) are answered at recording "
            "but not keyed: a batch of another kind replays the recording call's branch",
        ),
        Protection(
            "capture_branches",
            "both",
            "libraries that branch on capture (transformers' is_tracing) take another path in a recording than eager "
            "takes (an explicit attention mask instead of is_causal)",
        ),
        Protection(
            "compiled_code",
            "both",
            "torch.compile'd frames run while the emulated tape records: their kernels bypass the dispatcher and a replay reads stale buffers",
        ),
        Protection(
            "switches",
            "both",
            "process-wide kernel switches (SDPA backend, cuDNN/oneDNN enabled, TF32, matmul precision, deterministic "
            "algorithms) changed after recording replay the kernels recorded under the old ones",
        ),
        Protection(
            "cache_fills",
            "both",
            "a write into the model that does not recur at the next call (a cache filled at a new length) keeps the "
            "recordings made for the old state: one keyed without the new state replays the old cache",
        ),
        Protection(
            "hooks", "step", "module, gradient and optimizer hooks run at the recording call only"
        ),
        Protection(
            "side_effects",
            "step",
            "the step's Python effects (a module attribute assigned, an input written in place, a dict or "
            "object the model holds changed) are not looked for: the recording call makes them, replays do not",
        ),
        Protection(
            "loss_inputs",
            "step",
            "what loss_fn reads besides tensors (closure cells, globals, a criterion's attributes) is frozen at recording",
        ),
        Protection(
            "pool_survivors",
            "step",
            "a tensor the recording call's reference step leaves in the pool (its result when it stands, a cached tensor) is overwritten by an earlier recording's replay",
        ),
        Protection(
            "optimizer_trust",
            "step",
            "an optimizer whose step() is not known to be capture-safe replays without its Python",
        ),
        Protection(
            "foreign_grads",
            "step",
            "parameters outside the model that loss_fn reaches keep the gradient of the recording call",
        ),
        Protection(
            "host_choices",
            "both",
            "draws from Python's random or numpy that only choose a branch (LayerDrop) are drawn before each call but "
            "not keyed: a replay repeats the recording call's branch",
        ),
        Protection(
            "foreign_owners",
            "step",
            "a second network's parameter replaced after its gradients were recorded (a layer re-initialised) "
            "replays the old one",
        ),
        Protection(
            "state_identity",
            "step",
            "optimizer, scaler and EMA state tensors replaced (load_state_dict, add_param_group), or a group's "
            "params edited (a parameter moved to another group), replay the old ones",
        ),
        Protection(
            "grad_inputs",
            "optimizer_step",
            "the replayed optimizer step reads the gradients of its recording call, not the parameters' current .grad",
        ),
        Protection(
            "grad_rebind",
            "optimizer_step",
            "a step body assigning a new .grad (p.grad = p.grad * s) leaves the parameters the gradient it was given at replay",
        ),
        Protection(
            "host_values",
            "step",
            "the optimizer's, scaler's and clip's host values (a float lr) are not keyed: a changed one replays the old",
        ),
        Protection(
            "rank_agreement",
            "step",
            "under DDP each rank routes alone: one records or runs eagerly while another replays, their "
            "collectives no longer pair up (a hang, or gradients averaged across different steps)",
        ),
    )
}

#: Every protection's name.
PROTECTIONS: tuple[str, ...] = tuple(REGISTRY)


#: Step protections the replayed optimizer step (``replaykit.optimizer_step``) applies as well.
SHARED: dict[str, tuple[str, ...]] = {
    "optimizer_step": ("host_values", "state_identity", "optimizer_trust", "call_state")
}


def in_scope(scope: str) -> tuple[str, ...]:
    """The protections an entry point (``capture``, ``step`` or ``optimizer_step``) can switch off."""
    shared = SHARED.get(scope, ())
    return tuple(n for n, p in REGISTRY.items() if p.scope in (scope, "both") or n in shared)


#: protections of the recording call's verification itself (without it there is nothing to protect),
#: and those whose hazard the verification's own runs make (``data_rebind``: its eager rerun rebinds
#: the weight once more): a negative control keeps the verification on for these
OF_VERIFICATION = frozenset({"verify_recording", "pool_survivors", "call_state", "data_rebind"})


def negative_control(*names: str) -> tuple[str, ...]:
    """The ``unsafe_disable`` that shows a protection is needed: ``names`` and the recording's
    verification, which would otherwise catch at the first replay what a switched-off guard lets through
    (kept on for a protection of the verification itself)."""
    return names if OF_VERIFICATION.intersection(names) else (*names, "verify_recording")


class Switches:
    """Which protections are on for one entry point: a frozen record of booleans, one attribute per
    protection of :data:`REGISTRY` (``on.copy_out``), built once from ``unsafe_disable``. An
    attribute read is the per-call cost, not a string lookup in a set."""

    __slots__ = ("off", *REGISTRY)

    def __init__(self, disabled: Iterable[str] = ()) -> None:
        off = frozenset(disabled)
        unknown = sorted(off - set(REGISTRY))
        if unknown:
            raise ReplayError(f"unknown protection(s) {unknown}; choose from {list(REGISTRY)}")
        object.__setattr__(self, "off", off)
        for name in REGISTRY:
            object.__setattr__(self, name, name not in off)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Switches are fixed at construction")

    def __repr__(self) -> str:
        return f"Switches(off={sorted(self.off)})"


def disabled_protections(
    names: Iterable[str] | str, scope: str, stacklevel: int = 3
) -> frozenset[str]:
    """Validate ``unsafe_disable`` for an entry point and warn once per protection switched off."""
    if isinstance(names, str):
        names = (names,)
    chosen = frozenset(names)
    allowed = in_scope(scope)
    unknown = sorted(chosen - set(allowed))
    if unknown:
        raise ReplayError(
            f"unknown unsafe_disable name(s) {unknown} for {scope}; choose from {list(allowed)}"
        )
    for name in sorted(chosen):
        warnings.warn(
            f"replaykit: protection {name!r} is disabled ({REGISTRY[name].without}); results may differ from eager",
            ReplayWarning,
            stacklevel=stacklevel,
        )
    return chosen
