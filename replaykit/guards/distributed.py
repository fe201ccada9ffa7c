"""What a whole-step recording cannot hold under ``torch.distributed``, and where the ranks meet.

``DistributedDataParallel`` runs Python and collectives around every backward: its forward
prepares the reducer and broadcasts buffers, its autograd hooks all-reduce the gradients
bucket by bucket. A ``TrainStep`` over a DDP model therefore records two graphs (forward and
backward of ``ddp.module``; clipping and the optimizer) and runs DDP's work between them
(:mod:`replaykit.distributed.reduction`). What that reduction does not repeat bit for bit is refused here,
with the reason: the step then runs eagerly (real DDP), saying why.

The collectives inside a graph (NCCL's bucketed all-reduce captured in the backward graph) are
not offered: that path has not run on two GPUs, so it is refused with the reason rather than
replayed unproven.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

_DDP = getattr(torch.nn.parallel, "DistributedDataParallel", None)

#: why the collectives are not captured inside the graphs
IN_GRAPH_REFUSAL = (
    "collectives inside the graphs (NCCL's all-reduce captured in the backward graph) have not "
    "been proven on two GPUs: TrainStep runs DDP's all-reduce between its two graphs instead"
)


#: DDP's own flags its forward assigns; a replayed step's host work assigns them the same way
#: (:meth:`replaykit.distributed.reduction.DDPReduction.before_forward`), so they are no side effect there
REPEATED_DDP_FLAGS = frozenset({"require_forward_param_sync"})

#: the DDP wrappers a TrainStep drives in the two-graph form (their flags are repeated)
DRIVEN: weakref.WeakSet = weakref.WeakSet()


def repeated_by_replay(module: nn.Module, attr: str) -> bool:
    """Whether assigning ``attr`` on ``module`` is repeated by a replay's host work."""
    return attr in REPEATED_DDP_FLAGS and module in DRIVEN


def is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` wrapper."""
    return _DDP is not None and isinstance(model, _DDP)


def ddp_refusal(model: nn.Module) -> str | None:
    """Why a whole step over ``model`` must run eagerly under DDP, or None (a plain model, or a
    DDP whose reduction :class:`~replaykit.distributed.reduction.DDPReduction` repeats exactly)."""
    if _DDP is None:
        return None
    if not is_ddp(model):
        if any(isinstance(m, _DDP) for m in model.modules()):
            return (
                "DistributedDataParallel inside the model: pass the DDP wrapper itself as "
                "TrainStep's model (its reduction then runs between the step's two graphs)"
            )
        return None
    unsupported = {
        "find_unused_parameters": model.find_unused_parameters,
        "static_graph": getattr(model, "static_graph", False),
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "a communication hook": bool(getattr(model, "_comm_hooks", ())),
        "DDP's mixed_precision": getattr(model, "mixed_precision", None) is not None,
        "Join": getattr(getattr(model, "_join_config", None), "enable", False),
        "a buffer communication hook": hasattr(model, "buffer_hook"),
        "the Python reducer": getattr(model, "_use_python_reducer", False),
        "delay_all_reduce_named_params": bool(getattr(model, "_delay_all_reduce_params", ())),
    }
    found = [name for name, on in unsupported.items() if on]
    if found:
        return (
            f"DistributedDataParallel with {found[0]}: its reduction is not the reducer's default "
            "all-reduce the step repeats between its graphs; replay the wrapped module with "
            "rk.capture(ddp.module) and the optimizer step with replaykit.optimizer_step.OptimizerStep"
        )
    return None
