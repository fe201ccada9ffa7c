"""Changes no write notification reports, compared on every call before a replay.

A recording reads parameter and buffer memory by address and runs no submodule Python, so it
is stale when a storage changes (``.to()``, ``param.data = ...``), a parameter frozen at
recording starts to require grad (freezing is harmless: autograd drops the replayed gradient),
or global module hooks change (they would not run). The route
(:meth:`replaykit.route.Lifecycle.gate`) then records anew within ``max_rerecords``. Two C-level
``map`` passes per call; nothing process-wide refers to the module.
"""

from __future__ import annotations

from operator import attrgetter

import torch
from torch import nn
from torch.nn.modules import module as module_mod

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOKS = (
    module_mod._global_forward_pre_hooks,
    module_mod._global_forward_hooks,
    module_mod._global_backward_pre_hooks,
    module_mod._global_backward_hooks,
)
_requires_grad = attrgetter("requires_grad")
_data_ptr = torch.Tensor.data_ptr


def _sparse_ptrs(t: torch.Tensor) -> tuple[int, ...]:
    """A sparse tensor's storages' addresses (its compressed indices and values)."""
    if t.layout == torch.sparse_coo:
        return (t._indices().data_ptr(), t._values().data_ptr())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices().data_ptr(), t.col_indices().data_ptr(), t.values().data_ptr())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices().data_ptr(), t.row_indices().data_ptr(), t.values().data_ptr())
    return (id(t),)


def module_hooks(module: nn.Module) -> int:
    """Hooks of every module in the tree, the root's own included (a whole step runs those too)."""
    return sum(len(m.__dict__.get(name, ())) for m in module.modules() for name in _HOOK_DICTS)


def hook_dicts(module: nn.Module) -> list[dict]:
    """The hook dicts whose entries would run inside ``module.forward`` (not the top module's own)."""
    dicts = [getattr(m, name) for m in module.modules() if m is not module for name in _HOOK_DICTS]
    return dicts + list(GLOBAL_HOOKS)


class ModuleWatch:
    """Detects what no write notification reports; ``reason()`` names the first change found.
    Registrations, swapped tensors and submodule hooks are reported by
    :class:`replaykit.guards.module.ModuleGuard`; storage changes and ``requires_grad`` flips happen
    in C and are compared here on every call (one pass over parameters and buffers)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.rebaseline()

    def rebaseline(self) -> None:
        """Take the module as it is now as the reference (done while no recording exists)."""
        module = self._module
        tensors = [*module.parameters(), *module.buffers()]
        self._tensors = [t for t in tensors if t.layout == torch.strided]
        # a sparse buffer (a GNN's adjacency) has no data pointer: its indices' and values' are kept
        self._sparse = [t for t in tensors if t.layout != torch.strided]
        self._frozen = [p for p in module.parameters() if not p.requires_grad]
        self._ptrs = list(map(_data_ptr, self._tensors))
        self._sparse_ptrs = list(map(_sparse_ptrs, self._sparse))
        self._globals = sum(map(len, GLOBAL_HOOKS))
        self._hooks = sum(map(len, hook_dicts(module)))

    @property
    def hooks_at_start(self) -> int:
        return self._hooks

    def reason(self) -> str | None:
        """Why the recordings are no longer valid, or None when nothing changed."""
        if list(map(_data_ptr, self._tensors)) != self._ptrs or (
            self._sparse and list(map(_sparse_ptrs, self._sparse)) != self._sparse_ptrs
        ):
            return "parameter or buffer storage changed"
        if self._frozen and any(map(_requires_grad, self._frozen)):
            return "requires_grad of a parameter changed (a frozen parameter now requires grad)"
        if (
            any(GLOBAL_HOOKS)
            if self._globals == 0
            else sum(map(len, GLOBAL_HOOKS)) != self._globals
        ):
            return (
                "module hooks changed (global)"  # from none (the usual baseline): any hook at all
            )
        return None

    def close(self) -> None:
        """Pin no old tensors (e.g. after .cpu())."""
        self._tensors, self._frozen, self._sparse = [], [], []
