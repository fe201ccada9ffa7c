"""Crashes where eager runs: what a user passes or does that eager PyTorch accepts, and the
replaying entry point must either run exactly or refuse with a clear ``ReplayError``.

An optimizer checkpoint round trip through ``torch.load`` (``weights_only=True`` by default),
an ``nn.LSTM``, LBFGS (its ``step`` needs a closure), ``backend="cuda"`` on a machine without
a GPU, and a callable that is not an ``nn.Module``.

Here the eager arm is plain PyTorch where the step's eager twin could share the replay's
fault (a twin that raises too would hide it as "both raise").
"""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils import checkpoint as _checkpointing
from torch.utils.checkpoint import checkpoint

import replaykit as rk

from .pattern import Arm, Extras, Pattern, loop, mlp, sgd, step_loop
from .writing import HazardClass, built, looped, stepped

HAZARD = "crashes"
HC = HazardClass(HAZARD)

LossFn = Callable[..., torch.Tensor]


def _mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _plain_step(
    model: nn.Module, loss_fn: LossFn, opt: torch.optim.Optimizer
) -> Callable[..., torch.Tensor]:
    """What the step's eager twin does, written as a user's loop body (the eager arm's reference)."""

    def step(*batch: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _step_or_plain(
    arm: Arm, model: nn.Module, loss_fn: LossFn, opt: torch.optim.Optimizer, **kwargs: object
) -> Callable[..., torch.Tensor]:
    """``rk.TrainStep`` in the replay arm, the plain loop body in the eager arm."""
    if arm.replay:
        return arm.train_step(model, loss_fn, opt, **kwargs)
    arm.optimizers.append(opt)
    return _plain_step(model, loss_fn, opt)


# --------------------------------------------------------------------------- an optimizer checkpoint round trip
def _checkpoint_round_trip(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
) -> Callable[[nn.Module, Arm], Extras]:
    return lambda model, arm: _round_trip(model, arm, make_opt(model))


def _round_trip(model: nn.Module, arm: Arm, opt: torch.optim.Optimizer) -> Extras:
    """The optimizer's state saved mid-run and loaded back with torch.load's default (weights_only=True)."""
    step = _step_or_plain(arm, model, _mse, opt)
    kept: Extras = {}
    for i in range(6):
        if i == 3:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            buffer.seek(0)
            ckpt = torch.load(buffer)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
        kept[f"loss{i}"] = step(arm.randn(4, 6))
    return kept


# --------------------------------------------------------------------------- an LSTM
class Recurrent(nn.Module):
    """An LSTM over a short sequence, its last hidden state into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


# --------------------------------------------------------------------------- LBFGS
def _lbfgs(model: nn.Module, arm: Arm) -> Extras:
    """LBFGS handed to TrainStep (the replay arm) vs LBFGS's own closure loop (eager)."""
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    kept: Extras = {}
    if arm.replay:
        step = arm.train_step(model, _mse, opt)
        for i in range(4):
            kept[f"loss{i}"] = step(arm.randn(4, 6))
        return kept
    arm.optimizers.append(opt)
    for i in range(4):
        x = arm.randn(4, 6)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = _mse(model, x)
            loss.backward()
            return loss

        kept[f"loss{i}"] = opt.step(closure).detach()
    return kept


# --------------------------------------------------------------------------- backend and model type
def _cuda_without_gpu(model: nn.Module, arm: Arm) -> Extras:
    """``backend="cuda"`` asked for on a CPU model (no GPU here): must be a clear error, not a torch one."""
    opt = sgd(model)
    if arm.replay:
        step = rk.TrainStep(
            model, _mse, opt, backend="cuda"
        )  # where there is a GPU: a plain cuda step
        arm.recorder = step
    else:
        step = _plain_step(model, _mse, opt)
    arm.optimizers.append(opt)
    return {f"loss{i}": step(arm.randn(4, 6)) for i in range(4)}


def _function_model(model: nn.Module, arm: Arm) -> Extras:
    """The model handed over as its bound ``forward`` (a callable, not an nn.Module)."""
    opt = sgd(model)
    if arm.replay:
        step = rk.TrainStep(
            model.forward, lambda f, x: f(x).pow(2).mean(), opt, backend=arm.backend
        )
        arm.recorder = step
    else:
        step = _plain_step(model.forward, lambda f, x: f(x).pow(2).mean(), opt)
    arm.optimizers.append(opt)
    return {f"loss{i}": step(arm.randn(4, 6)) for i in range(4)}


PATTERNS: list[Pattern] = [
    HC.pattern(
        "step_optimizer_checkpoint_round_trip",
        "torch.save(SGD's state_dict()) then torch.load (weights_only default) and load_state_dict mid-run",
        mlp(),
        _checkpoint_round_trip(sgd),
        api="step",
    ),
    HC.pattern(
        "step_adam_checkpoint_round_trip",
        "the same round trip of Adam's state (its step count a tensor)",
        mlp(),
        _checkpoint_round_trip(lambda m: torch.optim.Adam(m.parameters(), lr=0.01)),
        api="step",
    ),
    HC.pattern(
        "step_lstm",
        "an nn.LSTM under TrainStep",
        built(Recurrent),
        stepped(steps=5, shape=(4, 5, 6)),
        api="step",
    ),
    HC.pattern(
        "lstm_captured",
        "an nn.LSTM under rk.capture",
        built(Recurrent),
        looped(steps=4, shape=(4, 5, 6)),
    ),
    HC.pattern(
        "step_lbfgs",
        "torch.optim.LBFGS handed to TrainStep (needs a closure)",
        mlp(),
        _lbfgs,
        api="step",
    ),
    HC.pattern(
        "step_backend_cuda_on_cpu_model",
        "TrainStep(backend='cuda') for a CPU model",
        mlp(),
        _cuda_without_gpu,
        api="step",
    ),
    HC.pattern(
        "step_non_module_model",
        "TrainStep given model.forward (a callable, not an nn.Module)",
        mlp(),
        _function_model,
        api="step",
    ),
    HC.pattern(
        "capture_non_module",
        "rk.capture given model.forward (a callable, not an nn.Module)",
        mlp(),
        looped(steps=3),
        target=lambda m: m.forward,
    ),
]


# --------------------------------------------------------------------------- issue #33, class 4
class RateScheduled(nn.Module):
    """A DropBlock-like rate from a numpy schedule: ``self.p = np.linspace(0, .3, 10)[i]`` (a numpy scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)
        self.p = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * float(1 - self.p)


def _numpy_rate(model: nn.Module, step: int) -> None:
    import numpy as np  # a user's dependency, not the harness's: imported when the pattern runs

    model.p = np.linspace(0, 0.3, 10)[min(step, 2)]


def _adjacency(device: str) -> torch.Tensor:
    idx = torch.tensor([[0, 1, 2, 3, 0, 2], [1, 2, 3, 0, 2, 1]])
    return torch.sparse_coo_tensor(idx, torch.ones(6), (4, 4), device=device).coalesce()


class GraphConv(nn.Module):
    """Two graph convolutions ``torch.sparse.mm(adj, x)``, the adjacency passed with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.out(torch.sparse.mm(adj, torch.relu(torch.sparse.mm(adj, self.lin(x)))))


def _graph(api: str) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        adj = _adjacency(arm.device)
        if api == "step":
            opt = sgd(model)
            step = arm.train_step(model, lambda m, x, a: m(x, a).pow(2).mean(), opt)
            return {f"loss{i}": step(arm.randn(4, 6), adj).detach() for i in range(4)}
        return loop(model, arm, steps=4, call=lambda m, x, s: m(x, adj))

    return train


SELECTIVE_CHECKPOINTING = hasattr(_checkpointing, "CheckpointPolicy")
"""Selective activation checkpointing's public API came with torch 2.5: its patterns need it."""


def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    policy = _checkpointing.CheckpointPolicy
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return policy.MUST_SAVE if op in matmuls else policy.PREFER_RECOMPUTE


class SelectiveCheckpointed(nn.Module):
    """A block under selective activation checkpointing (matmuls saved, the rest recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        contexts = partial(_checkpointing.create_selective_checkpoint_contexts, _save_matmuls)
        return self.head(checkpoint(self.block, x, use_reentrant=False, context_fn=contexts))


PATTERNS += [
    *HC.twins(
        "numpy_scalar_attribute",
        "a module attribute set to a numpy scalar each step (np.linspace(0, .3, 10)[i])",
        built(RateScheduled),
        looped(steps=4, before=_numpy_rate),
        lambda m, a: step_loop(m, a, steps=5, before=lambda m, o, s: _numpy_rate(m, s)),
        step_what="a module attribute set to a numpy scalar each step, whole step",
    ),
    *HC.twins(
        "sparse_adjacency_input",
        "a sparse COO adjacency passed with each batch, torch.sparse.mm(adj, x) (a GNN)",
        built(GraphConv),
        _graph("capture"),
        _graph("step"),
        step_what="a sparse COO adjacency passed with each batch, whole step",
    ),
]
if SELECTIVE_CHECKPOINTING:
    PATTERNS += [
        *HC.twins(
            "selective_activation_checkpointing",
            "checkpoint(..., use_reentrant=False, context_fn=create_selective_checkpoint_contexts(...))",
            built(SelectiveCheckpointed),
            looped(steps=4),
            stepped(steps=5),
            step_what="selective activation checkpointing, whole step",
        ),
    ]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
