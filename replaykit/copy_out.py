"""Copy-out of live aliases: tensors the caller holds that share a recording's static memory.

A replayed backward returns static gradient buffers, and AccumulateGrad adopts such a
buffer as ``.grad`` when ``.grad`` was None; a replayed forward returns static outputs.
Whoever still holds one of them at the next replay would see it overwritten (on CUDA,
by any replay in the recorder's shared pool). So before every replay each static
storage must be referenced by its recording alone:

- an alias the recorder can reach (a parameter's ``.grad``, an output the caller still
  holds) gets storage of its own: same values, same tensor, so every holder of that
  tensor keeps its values. This happens at forward time, before the replay; inside the
  replayed backward is too late (WP-206);
- an alias it cannot reach (a view of an output, a gradient kept by a callback after
  ``zero_grad(set_to_none=True)``) makes the call route eager (reason ``live_alias``),
  which leaves static memory alone, until that holder lets go.

Liveness is read from storage use counts (C-level, no references held), so a recording
whose aliases all died costs one comparison.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

_use_count = torch._C._storage_Use_Count


def _cdata(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class StaticAliases:
    """The static storages one recording hands out, and how to reach their holders."""

    __slots__ = ("_baseline", "_cdatas", "_grads", "_outputs", "_refs", "dirty")

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """``outputs``: static outputs to guard; ``grads``: (parameter, static gradient buffer) pairs."""
        self._outputs = list(outputs)
        self._grads = list(grads)
        self._cdatas = [_cdata(t) for t in self._outputs] + [_cdata(buf) for _, buf in self._grads]
        self._baseline = list(map(_use_count, self._cdatas))  # measured before anything is handed out
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.dirty = False

    def add_grads(self, grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Guard static gradient buffers captured later (before any of them is handed out)."""
        self._grads += grads
        cdatas = [_cdata(buf) for _, buf in grads]
        self._cdatas += cdatas
        self._baseline += list(map(_use_count, cdatas))

    def handed_out(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """Aliases went out: outputs (kept weakly, to reach them) or gradients (reached via ``.grad``)."""
        if self._outputs and outputs:
            self._refs = [weakref.ref(o) for o in outputs]
        self.dirty = True

    def _clean(self) -> bool:
        return list(map(_use_count, self._cdatas)) == self._baseline

    def copy_out(self) -> tuple[int, bool]:
        """Give reachable aliases their own storage; returns (copied, whether none is left)."""
        if not self.dirty:
            return 0, True
        if self._clean():
            self.dirty, self._refs = False, []
            return 0, True
        live = [t for ref in self._refs if (t := ref()) is not None and _cdata(t) in self._cdatas]
        live += [g for param, buf in self._grads if (g := param.grad) is not None and g.data_ptr() == buf.data_ptr()]
        if live:
            with torch.no_grad():
                fresh = [torch.empty_like(t) for t in live]
                torch._foreach_copy_(fresh, live)  # one launch per dtype/device, not one per tensor
                for t, f in zip(live, fresh, strict=True):
                    t.data = f
        copied = len(live)
        self._refs = []
        clean = self._clean()
        self.dirty = not clean
        return copied, clean
