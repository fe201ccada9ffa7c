"""DDP's gradient all-reduce between a whole step's two graphs, done as DDP's reducer does it.

Under ``DistributedDataParallel`` a replayed :class:`~replaykit.step.TrainStep` records the
forward, loss and backward of the wrapped module (``ddp.module``: no reducer hook fires, since
DDP's forward, which arms them, does not run) and, after it, clipping and the optimizer; between
the two (:mod:`replaykit.backends.gaps`) DDP's work runs on the host every step:

- before the forward, what DDP's ``forward`` does first: its buffer broadcast from rank 0 when
  the previous forward synchronised (``broadcast_buffers``), then its flag for the next one;
- after the backward, on a synchronising micro-batch (``no_sync`` skips it, as eager's hooks do):
  the reducer's arithmetic over the reducer's own buckets, read from DDP once it rebuilt them —
  each gradient multiplied by ``1 / world`` into its bucket, one SUM all-reduce per bucket on
  DDP's process group, copied back. Bucket for bucket this is the collective eager issues, so
  the bits are the same for any world size.

With ``ddp=`` (Lightning's DDP strategy in manual optimization, whose own DDP forward runs
around the step and leaves the reducer unarmed) the step runs the model inside the wrapper and
does no forward work of DDP's: before an eager synchronising backward it arms the reducer as
Lightning's ``manual_backward`` does (:func:`arm_reducer`), and a replay runs the all-reduce
after the backward as above.

A DDP configuration whose reduction differs from this (a communication hook, unused-parameter
detection, a static graph, gradients as bucket views, DDP's mixed precision, Join) is refused by
:func:`replaykit.guards.distributed.ddp_refusal` before anything is recorded.

On CUDA, DDP's reducer holds every parameter's gradient accumulator from its construction, and
autograd runs an accumulator on the stream current when it was made. Built on the default
(legacy) stream, the captured backward would have to make that stream wait on the capturing one,
which CUDA forbids (``cudaErrorStreamCaptureImplicit``); built on a side stream, as torch's CUDA
graphs notes ask of DDP (and Lightning's DDP strategy does), that stream joins the capture. So
the first eager backward looks at where the accumulation ran (:meth:`DDPReduction.stream_refusal`)
and a default-stream DDP runs eagerly, saying how to build it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ReplayError
from ..guards.distributed import DRIVEN
from .watchdog import Watchdog

__all__ = ["DDPReduction", "arm_reducer"]


def arm_reducer(ddp: nn.Module) -> None:
    """Before an eager backward of a model inside ``ddp`` whose forward the caller runs (``ddp=``):
    what Lightning's ``manual_backward`` does under its DDP strategy (``prepare_for_backward``),
    and DDP's own forward after the module ran. The reducer's hooks then all-reduce this
    backward's gradients; under ``no_sync`` (``require_backward_grad_sync`` off) they stay off.
    Lightning's DDP forward around ``training_step`` leaves them off in manual optimization."""
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        ddp.require_forward_param_sync = True
        ddp.reducer._rebuild_buckets()  # a no-op once DDP's forward rebuilt them (Lightning calls it)
        ddp.reducer.prepare_for_backward([])
    else:
        ddp.require_forward_param_sync = False


class DDPReduction:
    """The host work around a replayed step's graphs for one DDP model."""

    def __init__(self, ddp: nn.Module) -> None:
        self.ddp = ddp
        DRIVEN.add(ddp)  # its forward's flag is repeated by the replay's host work: no side effect
        self.group = ddp.process_group
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        #: the reducer's parameters, in its index order
        self.params = [
            p
            for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in ignored
        ]
        self._buckets: list[list[int]] | None = None
        self._flat: dict[tuple, torch.Tensor] = {}
        #: whether the accumulators ran on the default CUDA stream (None: not seen yet, or CPU)
        self._on_default: bool | None = None
        if self.params and self.params[0].is_cuda:
            self._probe = self.params[0].register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        """A one-shot hook: autograd runs the accumulator under its own stream."""
        self._on_default = torch.cuda.current_stream(param.device) == torch.cuda.default_stream(
            param.device
        )
        self._probe.remove()

    def stream_refusal(self) -> str | None:
        """Why the backward cannot be captured: DDP built on the default CUDA stream, or None."""
        if not self._on_default:
            return None
        return (
            "ddp_default_stream: DistributedDataParallel was built on the default CUDA stream, "
            "where its gradient accumulators then run, and a captured backward cannot make that "
            "stream wait on the capture; build it under `with torch.cuda.stream(torch.cuda.Stream()):` "
            "as torch's CUDA graphs notes ask of DDP (Lightning's DDP strategy does)"
        )

    def ready(self) -> bool:
        """Whether DDP rebuilt its buckets (in its second forward): the layout the reduction follows."""
        if self.params and self.params[0].is_cuda and self._on_default is None:
            return False  # no eager backward seen yet: where its accumulators run is unknown
        if self._buckets is None:
            if not getattr(self.ddp, "_has_rebuilt_buckets", False):
                return False
            data = self.ddp._get_ddp_logging_data()
            text = str(data.get("rebuilt_per_bucket_param_indices", ""))
            if not text.strip():
                return False
            self._buckets = [[int(i) for i in b.split()] for b in text.split(",") if b.strip()]
            if sorted(i for b in self._buckets for i in b) != list(range(len(self.params))):
                raise ReplayError(
                    "replaykit: DDP's bucket layout does not name each of its parameters once: "
                    f"{text!r} for {len(self.params)} parameters"
                )
        return True

    def before_forward(self, sync: bool) -> Callable[[], None]:
        """DDP's forward's own host work before the module runs (``sync``: this micro-batch all-reduces)."""
        ddp = self.ddp

        def work() -> None:
            if ddp._check_sync_bufs_pre_fwd():
                ddp._sync_buffers()
            ddp.require_forward_param_sync = (
                sync and torch.is_grad_enabled() and ddp.require_backward_grad_sync
            )

        return work

    def after_backward(
        self, grads: Sequence[torch.Tensor | None], watchdog: Watchdog | None
    ) -> Callable[[], None]:
        """The all-reduce of ``grads`` (the reducer's parameters' gradients, the static buffers a
        replay writes), bound now and run at every replay."""
        if not self.ready():
            raise ReplayError("replaykit: DDP has not rebuilt its buckets yet")
        assert self._buckets is not None
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing:
            raise ReplayError(
                f"replaykit: DDP parameter(s) {missing[:5]} got no gradient: DDP without "
                "find_unused_parameters expects every one (eager DDP raises too)"
            )
        plan = [
            self._bucket([g for g in map(grads.__getitem__, b) if g is not None])
            for b in self._buckets
        ]
        scale = 1.0 / dist.get_world_size(self.group)
        ddp, group = self.ddp, self.group

        def work() -> None:
            if not ddp.require_backward_grad_sync:
                return
            for flat, views, gs in plan:
                for v, g in zip(views, gs, strict=True):
                    torch.mul(g, scale, out=v)  # the reducer's mul_out(bucket_view, grad, 1/world)
                if watchdog is None:
                    dist.all_reduce(flat, group=group)
                else:
                    work = dist.all_reduce(flat, group=group, async_op=True)
                    watchdog.wait(work, "DDP's gradient all-reduce between the graphs")
                for v, g in zip(views, gs, strict=True):
                    g.copy_(v)

        return work

    def forget(self) -> None:
        """Drop the bucket buffers (the recordings that shared them were freed)."""
        self._flat.clear()

    def _bucket(self, grads: list[torch.Tensor]) -> tuple:
        """One bucket's flat buffer (kept: a replay allocates nothing) and a view per gradient,
        laid out like the gradient (the reducer's bucket views follow dense parameters' strides)."""
        numel = sum(g.numel() for g in grads)
        key = (grads[0].dtype, grads[0].device, tuple(g.data_ptr() for g in grads))
        flat = self._flat.get(key)
        if flat is None:
            flat = self._flat[key] = torch.empty(
                numel, dtype=grads[0].dtype, device=grads[0].device
            )
        views, offset = [], 0
        for g in grads:
            if torch.empty_like(g).stride() == g.stride():  # dense: empty_like keeps its layout
                views.append(flat.as_strided(g.size(), g.stride(), offset))
            else:
                views.append(flat[offset : offset + g.numel()].view(g.size()))
            offset += g.numel()
        return flat, views, grads
