"""What a whole-step recording cannot hold under ``torch.distributed``: DDP's reducer.

DDP runs Python and collectives around every backward (reducer preparation, bucket rebuilds,
``no_sync``, all-reduce hooks), which a whole-step graph would freeze. So a ``TrainStep`` over
DDP runs eagerly and names the exact alternative: ``rk.capture(ddp.module)`` plus
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
