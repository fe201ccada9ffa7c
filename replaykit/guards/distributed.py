"""What a whole-step recording cannot hold under ``torch.distributed``: DDP's reducer.

``DistributedDataParallel`` runs Python and collectives around every backward: its forward
prepares the reducer (``require_forward_param_sync``, bucket rebuilds on the first steps,
``find_unused_parameters``' graph walk, ``no_sync``), and its autograd hooks all-reduce the
gradients bucket by bucket. A whole-step graph would freeze that bookkeeping at the recording
call. So a ``TrainStep`` over a DDP model runs eagerly, saying why, and the exact alternative
is named: network replay of the wrapped module (``rk.capture(ddp.module)``: DDP's forward, its
reducer and its collectives stay outside the graphs) and the optimizer step replayed by
:class:`~replaykit.optimizer_step.OptimizerStep`.
"""

from __future__ import annotations

import torch
from torch import nn

_DDP = getattr(torch.nn.parallel, "DistributedDataParallel", None)


def ddp_refusal(model: nn.Module) -> str | None:
    """Why a whole step over ``model`` must run eagerly under DDP, or None."""
    if _DDP is None or not any(isinstance(m, _DDP) for m in model.modules()):
        return None
    return (
        "DistributedDataParallel: its reducer runs Python and collectives around each backward "
        "that a whole-step graph would freeze; replay the wrapped module with "
        "rk.capture(ddp.module) and the optimizer step with replaykit.optimizer_step.OptimizerStep"
    )
