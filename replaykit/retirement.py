"""What makes recordings invalid for good, checked on every call before a replay.

A recording reads parameter and buffer memory by address and runs no Python of the
submodules, so the recorder retires (permanent eager, graphs freed) when
- a parameter, buffer or submodule is registered anew in the module tree
  (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``),
- a parameter's or buffer's storage changes (``.to()`` of dtype or device,
  ``param.data = ...``), or a parameter's ``requires_grad`` flips,
- forward or backward hooks of submodules (or global module hooks) change: under
  replay they would silently not run.
The per-call check is a few C-level ``map`` passes, flat in the number of calls.
"""

from __future__ import annotations

from operator import attrgetter

import torch
from torch import nn
from torch.nn.modules import module as module_mod

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = (
    module_mod._global_forward_pre_hooks,
    module_mod._global_forward_hooks,
    module_mod._global_backward_pre_hooks,
    module_mod._global_backward_hooks,
)
_requires_grad = attrgetter("requires_grad")


def hook_dicts(module: nn.Module) -> list[dict]:
    """The hook dicts whose entries would run inside ``module.forward`` (not the top module's own)."""
    dicts = [getattr(m, name) for m in module.modules() if m is not module for name in _HOOK_DICTS]
    return dicts + list(_GLOBAL_HOOKS)


class ModuleWatch:
    """Detects the changes above since construction; ``reason()`` names the first one found."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.rebaseline()
        self._handles = [
            module_mod.register_module_parameter_registration_hook(self._on_register("parameter")),
            module_mod.register_module_buffer_registration_hook(self._on_register("buffer")),
            module_mod.register_module_module_registration_hook(self._on_register("submodule")),
        ]

    def rebaseline(self) -> None:
        """Take the module as it is now as the reference (done while no recording exists)."""
        module = self._module
        self._modules = {id(m) for m in module.modules()}
        self._tensors = [*module.parameters(), *module.buffers()]
        self._params = list(module.parameters())
        self._ptrs = list(map(torch.Tensor.data_ptr, self._tensors))
        self._flags = list(map(_requires_grad, self._params))
        self._hook_dicts = hook_dicts(module)
        self._hooks = sum(map(len, self._hook_dicts))
        self._registered: str | None = None

    @property
    def hooks_at_start(self) -> int:
        return self._hooks

    def _on_register(self, what: str):
        def hook(owner: nn.Module, name: str, value: object) -> None:
            if id(owner) in self._modules and self._registered is None:
                self._registered = f"{what} {name!r} registered anew"

        return hook

    def reason(self) -> str | None:
        """Why the recordings are no longer valid, or None when nothing changed."""
        if self._registered is not None:
            return self._registered
        if list(map(torch.Tensor.data_ptr, self._tensors)) != self._ptrs:
            return "parameter or buffer storage changed"
        if list(map(_requires_grad, self._params)) != self._flags:
            return "requires_grad of a parameter changed"
        if sum(map(len, self._hook_dicts)) != self._hooks:
            return "module hooks changed"
        return None

    def close(self) -> None:
        """Remove the global registration hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._tensors, self._params, self._hook_dicts = [], [], []  # pin no old tensors (e.g. after .cpu())
