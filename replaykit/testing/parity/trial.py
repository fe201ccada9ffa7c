"""A small plain-PyTorch training loop run twice, eager and under replay, for bitwise comparison.

This is the core library's parity harness (the Lightning one lives in
``replaykit.testing.parity.arms``): the same seed, batches and schedule, then the whole end state
(parameters, buffers, the gradients of every optimizer step with their None pattern,
optimizer state, losses, outputs the caller kept) compared bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from replaykit.capturing import capture
from replaykit.recorder import Recorder

from ...verify.bitwise import TensorDiff, diff_states

State = dict[str, torch.Tensor | None]


@dataclass(frozen=True)
class Trial:
    """One training schedule. ``steps`` optimizer steps of ``accumulation`` micro-batches each."""

    steps: int = 3
    accumulation: int = 1
    batch: int = 4
    size: int = 12
    in_channels: int = 3
    features: int | None = None  # flat inputs (B, features) instead of images
    partial: str | None = (
        None  # None, "last" (last micro-batch smaller) or "between" (one inside a window)
    )
    set_to_none: bool = True
    read: tuple[int, ...] | None = None  # which flat outputs the loss reads; None reads all
    channels_last: bool = False  # model and inputs
    channels_last_inputs: bool = (
        False  # inputs only: outputs and loss gradients then differ in layout
    )
    loss: str = "mixed"  # "mixed" (nonlinear) or "sum" (broadcast gradients, stride 0)
    autocast: torch.dtype | None = None
    two_forwards: bool = False  # two forwards before one backward on each micro-batch
    keep_outputs: bool = False  # hold every micro-batch's outputs to the end
    keep_grads: bool = False  # a "callback" keeps each step's .grad tensors after zero_grad
    lr: float = 0.05
    seed: int = 0
    device: str = "cpu"

    def with_(self, **changes: Any) -> Trial:
        return replace(self, **changes)


@dataclass
class Outcome:
    """What one arm of a trial ended with."""

    state: State
    recorder: dict[str, Any] | None = None
    journal: str = ""
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def batch_sizes(trial: Trial) -> list[int]:
    """Micro-batch sizes; a partial batch is half a full one."""
    n = trial.steps * trial.accumulation
    sizes = [trial.batch] * n
    half = max(1, trial.batch // 2)
    if trial.partial == "last":
        sizes[-1] = half
    elif trial.partial == "between":
        sizes[min(n - 1, max(1, trial.accumulation) if n > 1 else 0)] = half
    elif trial.partial is not None:
        raise ValueError(f"partial must be None, 'last' or 'between', not {trial.partial!r}")
    return sizes


def make_inputs(trial: Trial) -> list[torch.Tensor]:
    """Deterministic micro-batch inputs for ``trial`` on its device."""
    g = torch.Generator().manual_seed(1000 + trial.seed)
    inputs = []
    for b in batch_sizes(trial):
        shape = (
            (b, trial.features)
            if trial.features
            else (b, trial.in_channels, trial.size, trial.size)
        )
        x = torch.randn(shape, generator=g).to(trial.device)
        if (trial.channels_last or trial.channels_last_inputs) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        inputs.append(x)
    return inputs


def loss_of(outputs: Any, read: tuple[int, ...] | None, kind: str = "mixed") -> torch.Tensor:
    """A loss over the flat outputs the loss reads: nonlinear ("mixed") or a plain sum ("sum")."""
    flat, _ = tree_flatten(outputs)
    chosen = [flat[i] for i in read] if read is not None else flat
    total = torch.zeros((), device=chosen[0].device)
    for k, o in enumerate(chosen):
        o = o.float()
        if kind == "sum":
            total = total + (k + 1) * 0.01 * o.sum()
        else:
            total = total + o.square().mean() + (k + 1) * 0.1 * torch.tanh(o).mean()
    return total


def flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> State:
    """Parameters, buffers and the optimizer's tensor state, detached copies keyed for :func:`~replaykit.verify.bitwise.diff_states`."""
    state: State = {}
    for name, p in model.named_parameters():
        state[f"param/{name}"] = p.detach().clone()
    for name, b in model.named_buffers():
        state[f"buffer/{name}"] = b.detach().clone()
    names = {p: n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                state[f"optim/{names[p]}/{key}"] = value.detach().clone()
    return state


def scaled_step(opt: torch.optim.Optimizer, scaler: Any) -> None:
    """Eager's optimizer step, through the grad scaler when there is one, then
    ``zero_grad(set_to_none=True)``: the reference loops' step after their backward."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def grads(model: nn.Module, prefix: str) -> State:
    """Each parameter's ``.grad`` (``None`` kept: the None pattern is compared too), under ``prefix``."""
    return {
        f"{prefix}/{n}": None if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
    }


def run(
    trial: Trial,
    make_model: Callable[[], nn.Module],
    capture_kwargs: dict[str, Any] | None = None,
) -> Outcome:
    """Train a fresh model on ``trial``: eagerly when ``capture_kwargs`` is None, else under replay."""
    torch.manual_seed(trial.seed)
    model = make_model().to(trial.device)
    if trial.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=trial.lr, momentum=0.9, weight_decay=1e-4)
    rec: Recorder | None = capture(model, **capture_kwargs) if capture_kwargs is not None else None
    torch.manual_seed(trial.seed + 1)
    state: State = {}
    kept_outputs: list[Any] = []
    kept_grads: list[State] = []
    live_kept: list[dict[str, torch.Tensor]] = []
    losses: list[float] = []
    autocast = (
        torch.autocast(torch.device(trial.device).type, dtype=trial.autocast)
        if trial.autocast is not None
        else nullcontext()
    )
    start = time.perf_counter()
    inputs = make_inputs(trial)
    step = 0
    for i, x in enumerate(inputs):
        with autocast:
            out = model(x)
            loss = loss_of(out, trial.read, trial.loss)
            if trial.two_forwards:
                loss = loss + 0.5 * loss_of(model(x.flip(0)), trial.read, trial.loss)
        (loss / trial.accumulation).backward()
        losses.append(float(loss.detach()))
        if trial.keep_outputs:
            kept_outputs.append(out)
        del out, loss
        if (i + 1) % trial.accumulation == 0 or i == len(inputs) - 1:
            state.update(grads(model, f"grad/step{step}"))
            opt.step()
            if trial.keep_grads:
                live_kept.append(
                    {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                )
            opt.zero_grad(set_to_none=trial.set_to_none)
            step += 1
    if trial.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    state.update(flat_state(model, opt))
    state.update(grads(model, "grad/end"))
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    for k, out in enumerate(kept_outputs):
        for j, t in enumerate(tree_flatten(out)[0]):
            state[f"kept_output/{k}/{j}"] = t.detach().clone()
    for k, held in enumerate(live_kept):
        kept_grads.append({f"kept_grad/{k}/{n}": g.detach().clone() for n, g in held.items()})
    for held in kept_grads:
        state.update(held)
    outcome = Outcome(state, seconds=seconds, losses=losses)
    if rec is not None:
        outcome.recorder = {**rec.journal.summary(), "retired": rec.retire_reason}
        outcome.journal = rec.journal.format()
        rec.release()
    return outcome


def compare(
    trial: Trial, make_model: Callable[[], nn.Module], **capture_kwargs: Any
) -> tuple[list[TensorDiff], Outcome, Outcome]:
    """Run ``trial`` eagerly and under replay; the diff rows are empty when they end bitwise equal."""
    eager = run(trial, make_model)
    replay = run(trial, make_model, capture_kwargs)
    return diff_states(eager.state, replay.state), eager, replay


def arms(
    trial: Trial, make_model: Callable[[], nn.Module], **capture_kwargs: Any
) -> Iterator[tuple[str, list[TensorDiff], Outcome]]:
    """The replay arm, then one arm per protection switched off, each compared with eager."""
    from replaykit.protections import PROTECTIONS, negative_control

    eager = run(trial, make_model)
    yield "replay", diff_states(eager.state, (r := run(trial, make_model, capture_kwargs)).state), r
    for name in PROTECTIONS:
        arm = run(trial, make_model, {**capture_kwargs, "unsafe_disable": negative_control(name)})
        yield f"unsafe:{name}", diff_states(eager.state, arm.state), arm
