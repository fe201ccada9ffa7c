"""Copy-out of live aliases: tensors the caller holds that share a recording's static memory.

A replay returns static outputs and gradient buffers (AccumulateGrad adopts one as ``.grad``);
whoever still holds one at the next replay would see it overwritten. So before every replay:

- an alias the recorder can reach (a ``.grad``, a held output) gets storage of its own (same
  tensor, same values), at forward time: inside the replayed backward is too late;
- an alias it cannot reach (a view of an output, a gradient a callback kept) routes the call
  eager (``live_alias``) until its holder lets go.

Liveness is read from storage use counts (C-level, no references held): one comparison when
every alias died.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

_use_count = torch._C._storage_Use_Count


def _cdata(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class StaticAliases:
    """The static storages one recording hands out, and how to reach their holders. Outputs and
    gradient buffers are handed out by different halves of a replay (its forward, its replayed
    backward), so each half's use counts are read only after it handed something out: a backward run
    exactly through the recorded graph (partial, ``multi_backward``) or a forward whose graph was
    dropped leaves the other half alone."""

    __slots__ = (
        "_grad_baseline",
        "_grad_cdatas",
        "_grads",
        "_grads_out",
        "_out_baseline",
        "_out_cdatas",
        "_outputs",
        "_outputs_out",
        "_refs",
        "dirty",
    )

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """``outputs``: static outputs to guard; ``grads``: (parameter, static gradient buffer) pairs."""
        self._outputs = list(outputs)
        self._out_cdatas = [_cdata(t) for t in self._outputs]
        # measured before anything is handed out
        self._out_baseline = list(map(_use_count, self._out_cdatas))
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad_cdatas: list[int] = []
        self._grad_baseline: list[int] = []
        self.add_grads(grads)
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self._outputs_out = self._grads_out = (
            False  # handed out since their use counts were last at baseline
        )
        self.dirty = False

    def add_grads(self, grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Guard static gradient buffers captured later (before any of them is handed out)."""
        self._grads += grads
        cdatas = [_cdata(buf) for _, buf in grads]
        self._grad_cdatas += cdatas
        self._grad_baseline += list(map(_use_count, cdatas))

    def handed_out(self, outputs: Sequence[torch.Tensor]) -> None:
        """A replayed forward returned ``outputs`` (kept weakly, to reach them)."""
        if self._outputs:
            self._refs = [weakref.ref(o) for o in outputs]
        self._outputs_out = self.dirty = True

    def handed_out_grads(self) -> None:
        """A replayed backward returned the gradient buffers (reached later via ``.grad``)."""
        self._grads_out = self.dirty = True

    def _settle(self) -> bool:
        """Clear each half whose use counts are back at baseline; True when nothing is aliased."""
        if self._outputs_out and list(map(_use_count, self._out_cdatas)) == self._out_baseline:
            self._outputs_out, self._refs = False, []
        if self._grads_out and list(map(_use_count, self._grad_cdatas)) == self._grad_baseline:
            self._grads_out = False
        self.dirty = self._outputs_out or self._grads_out
        return not self.dirty

    def copy_out(self) -> tuple[int, bool]:
        """Give reachable aliases their own storage; returns (copied, whether none is left)."""
        if not self.dirty or self._settle():
            return 0, True
        cdatas = {*self._out_cdatas, *self._grad_cdatas}
        live = [t for ref in self._refs if (t := ref()) is not None and _cdata(t) in cdatas]
        live += [
            g
            for param, buf in self._grads
            if (g := param.grad) is not None and g.data_ptr() == buf.data_ptr()
        ]
        if live:
            with torch.no_grad():
                fresh = [torch.empty_like(t) for t in live]
                torch._foreach_copy_(fresh, live)  # one launch per dtype/device, not one per tensor
                for t, f in zip(live, fresh, strict=True):
                    t.data = f
        self._refs = []
        self._outputs_out = self._grads_out = True  # read both halves again
        return len(live), self._settle()
