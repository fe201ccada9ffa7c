"""Autograd modes and transforms around a recorded model: anomaly detection switched on
mid-run, a user's saved-tensor hooks (activation compression, CPU offload), ``torch.func``
transforms, activation checkpointing around a captured module, and an input modified in
place between a forward and its backward.

Each changes what autograd does in Python or in the engine (a NaN check, a pack/unpack
hook, a version-counter check, a re-run forward) - work a recorded graph does not repeat.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

from .pattern import MLP, Arm, Extras, Pattern, loop, loss_steps, mlp, sgd, step_loop
from .writing import HazardClass, built, looped, stepped

HAZARD = "autograd_modes"
HC = HazardClass(HAZARD)


# --------------------------------------------------------------------------- anomaly detection
@contextlib.contextmanager
def anomaly_restored() -> Iterator[None]:
    was = torch.is_anomaly_enabled()
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(was)


def _nan_batch(arm: Arm, step: int, bad: int) -> torch.Tensor:
    x = arm.randn(4, 6)
    if step == bad:
        x[0, 0] = float("nan")  # a corrupt sample: anomaly mode names the backward that returns NaN
    return x


def _anomaly_capture(model: nn.Module, arm: Arm) -> Extras:
    """Anomaly detection switched on to debug after a few steps; the next batch has a NaN (eager raises)."""
    with anomaly_restored():
        opt = sgd(model)
        kept: Extras = {}
        for i in range(5):
            if i == 3:
                torch.autograd.set_detect_anomaly(True)
            opt.zero_grad(set_to_none=True)
            loss = model(
                _nan_batch(arm, i, 4)
            ).mean()  # the NaN shows first in the model's own backward
            loss.backward()
            opt.step()
            kept[f"loss{i}"] = loss.detach()
        return kept


def _anomaly_step(model: nn.Module, arm: Arm) -> Extras:
    with anomaly_restored():
        opt = sgd(model)
        step = arm.train_step(model, lambda m, x: m(x).mean(), opt)
        kept: Extras = {}
        for i in range(6):
            if i == 4:
                torch.autograd.set_detect_anomaly(True)
            kept[f"loss{i}"] = step(_nan_batch(arm, i, 5))
        return kept


def _anomaly_throughout(
    train: Callable[[nn.Module, Arm], Extras],
) -> Callable[[nn.Module, Arm], Extras]:
    """Anomaly detection left on for the whole run (no NaN comes): the control."""

    def run(model: nn.Module, arm: Arm) -> Extras:
        with anomaly_restored():
            torch.autograd.set_detect_anomaly(True)
            return train(model, arm)

    return run


# --------------------------------------------------------------------------- saved-tensor hooks
def _compress() -> contextlib.AbstractContextManager:
    """Activation compression: saved tensors kept in bfloat16, restored to their dtype for backward."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: (t.dtype, t.to(torch.bfloat16)), lambda packed: packed[1].to(packed[0])
    )


def _compressed_from(at: int) -> Callable[[nn.Module, torch.Tensor, int], torch.Tensor]:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        if step < at:
            return m(x)
        with _compress():  # backward runs after the context: the packed tensors were made here
            return m(x)

    return call


def _compressed_step(at: int) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        opt = sgd(model)
        step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt)
        kept: Extras = {}
        for i in range(6):
            with _compress() if i >= at else contextlib.nullcontext():
                kept[f"loss{i}"] = step(arm.randn(4, 6))
        return kept

    return train


def _save_on_cpu_loss(model: nn.Module, arm: Arm) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu():
        return model(arm.randn(4, 6)).pow(2).mean()


def _save_on_cpu_capture(model: nn.Module, arm: Arm) -> Extras:
    return loss_steps(model, arm, _save_on_cpu_loss)


def _save_on_cpu_step(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt)
    kept: Extras = {}
    for i in range(5):
        with torch.autograd.graph.save_on_cpu():
            kept[f"loss{i}"] = step(arm.randn(4, 6))
    return kept


# --------------------------------------------------------------------------- torch.func
def _per_sample_clipped(model: nn.Module, arm: Arm) -> Extras:
    """DP-SGD: per-sample gradients with vmap(grad(...)) over the model, clipped, averaged."""
    opt = sgd(model)
    kept: Extras = {}
    params = {n: p.detach() for n, p in model.named_parameters()}

    def sample_loss(ps: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, ps, (x.unsqueeze(0),)).pow(2).mean()

    for i in range(3):
        params = {n: p.detach() for n, p in model.named_parameters()}
        per_sample = vmap(grad(sample_loss), in_dims=(None, 0))(params, arm.randn(4, 6))
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
        factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        for n, p in model.named_parameters():
            g = per_sample[n]
            p.grad = (g * factor.view(-1, *[1] * (g.dim() - 1))).mean(0)
        opt.step()
        kept[f"norms{i}"] = norms
    return kept


def _saliency_logged(model: nn.Module, arm: Arm) -> Extras:
    """Input saliency with torch.func.grad over the model each step (logged), then a plain step."""
    kept: Extras = {}

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        kept[f"saliency{step}"] = grad(lambda inp: m(inp).sum())(x)
        return m(x)

    kept.update(loop(model, arm, steps=4, call=call))
    return kept


def _vmapped_forward(model: nn.Module, arm: Arm) -> Extras:
    """vmap(model) over a stack of batches (several augmentations at once), then a plain backward."""
    return loop(model, arm, steps=4, shape=(3, 4, 6), call=lambda m, x, s: vmap(m)(x))


# --------------------------------------------------------------------------- checkpointing a captured module
class CheckpointedBlock(nn.Module):
    """An embedding layer, then a block under ``torch.utils.checkpoint`` (the block is the captured module)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 6)
        self.block = MLP(d_out=6)
        self.head = nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(checkpoint(self.block, h, use_reentrant=self.reentrant))


# --------------------------------------------------------------------------- an input written before backward
def _input_refilled_before_backward(model: nn.Module, arm: Arm) -> Extras:
    """The batch buffer is refilled in place (the next batch prefetched) before backward: eager raises."""
    opt = sgd(model)
    kept: Extras = {}
    buffer = arm.randn(4, 6)
    for i in range(4):
        opt.zero_grad(set_to_none=True)
        loss = model(buffer).pow(2).mean()
        if i == 3:
            buffer.copy_(arm.randn(4, 6))  # the prefetch lands before backward
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()
        if i < 3:
            buffer = arm.randn(4, 6)
    return kept


PATTERNS: list[Pattern] = [
    HC.pattern(
        "anomaly_detection_mid_run",
        "set_detect_anomaly(True) after 3 steps; then a NaN batch (eager raises)",
        mlp(),
        _anomaly_capture,
    ),  # no guard: the replay's backward node is checked by anomaly mode too
    HC.pattern(
        "step_anomaly_detection_mid_run",
        "set_detect_anomaly(True) after recording; then a NaN batch",
        mlp(),
        _anomaly_step,
        guard="autograd_modes",
        api="step",
    ),
    *HC.twins(
        "anomaly_detection_throughout",
        "set_detect_anomaly(True) for the whole run, no NaN",
        mlp(),
        _anomaly_throughout(lambda m, a: loop(m, a, steps=4)),
        _anomaly_throughout(lambda m, a: step_loop(m, a, steps=5)),
    ),
    *HC.twins(
        "saved_tensors_compression_midway",
        "bf16 activation compression (saved_tensors_hooks) from step 2",
        mlp(),
        looped(steps=5, call=_compressed_from(2)),
        _compressed_step(3),
        step_what="bf16 activation compression around the step from call 3",
        guard="autograd_modes",
    ),
    *HC.twins(
        "saved_tensors_compression_throughout",
        "bf16 activation compression around every forward",
        mlp(),
        looped(steps=4, call=_compressed_from(0)),
        _compressed_step(0),
        step_what="bf16 activation compression around every step",
    ),
    *HC.twins(
        "save_on_cpu",
        "torch.autograd.graph.save_on_cpu() around the forward",
        mlp(),
        _save_on_cpu_capture,
        _save_on_cpu_step,
        step_what="torch.autograd.graph.save_on_cpu() around the step",
    ),
    HC.pattern(
        "func_per_sample_grads",
        "DP-SGD: vmap(grad(functional_call(model))) per-sample gradients",
        mlp(),
        _per_sample_clipped,
        guard="param_identity+autograd_modes",
    ),  # functional_call under vmap: both route it
    HC.pattern(
        "func_grad_input_saliency",
        "torch.func.grad of the model's output w.r.t. its input, logged each step",
        mlp(),
        _saliency_logged,
        guard="autograd_modes",
    ),
    HC.pattern(
        "func_vmap_forward",
        "vmap(model) over a stack of batches, then backward",
        mlp(),
        _vmapped_forward,
        guard="autograd_modes",
    ),
    HC.pattern(
        "checkpoint_reentrant_captured_block",
        "a captured block under checkpoint(use_reentrant=True)",
        lambda d: CheckpointedBlock(True).to(d),
        looped(steps=4),
        target=lambda m: m.block,
        may_hang=True,
        timeout_s=60,
    ),  # replays bitwise on the CPU (the no_grad first pass runs eager)
    HC.pattern(
        "checkpoint_nonreentrant_captured_block",
        "a captured block under checkpoint(use_reentrant=False)",
        lambda d: CheckpointedBlock(False).to(d),
        looped(steps=4),
        target=lambda m: m.block,
        guard="autograd_modes",
        may_hang=True,
        timeout_s=60,
    ),
    *(
        HC.pattern(
            f"step_checkpoint_{kind}",
            f"checkpoint(use_reentrant={reentrant}) inside the model of a TrainStep",
            built(CheckpointedBlock, reentrant),
            stepped(steps=5),
            api="step",
            may_hang=True,
            timeout_s=60,
        )
        for kind, reentrant in (("reentrant", True), ("nonreentrant", False))
    ),
    HC.pattern(
        "input_refilled_before_backward",
        "the input buffer refilled in place between forward and backward",
        mlp(),
        _input_refilled_before_backward,
        guard="input_versions",
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
