"""What eager runs must not crash under replay (issue #33, class 4): it replays exactly, runs eagerly
with a reason, or raises a clear ReplayError."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils import checkpoint as checkpointing

import replaykit as rk


def _capture_step(model: nn.Module, unsafe: tuple[str, ...] = ()) -> tuple[Callable, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec = rk.capture(model, backend="emulated", unsafe_disable=unsafe)

    def step(*args: object) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(*args).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step, rec


def _train_step(model: nn.Module, unsafe: tuple[str, ...] = ()) -> tuple[Callable, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = rk.TrainStep(
        model,
        lambda m, *a: m(*a).square().mean(),
        opt,
        backend="emulated",
        unsafe_disable=unsafe,
    )
    return (lambda *a: step(*a).detach()), step


def _eager_step(model: nn.Module) -> Callable:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(*args: object) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(*args).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


ENTRIES = {"capture": _capture_step, "step": _train_step}


def _state(model: nn.Module, losses: list[torch.Tensor]) -> list[torch.Tensor]:
    return [*losses, *(t.detach().to_dense().clone() for t in model.state_dict().values())]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- numpy scalar attribute
class ScheduledDrop(nn.Module):
    """A DropBlock-like rate set from a numpy schedule: ``self.p = np.linspace(0, .3, 10)[i]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.p = np.linspace(0, 0.3, 10)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(1 - self.p)


def _scheduled(model: ScheduledDrop, step: Callable) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    schedule = np.linspace(0, 0.3, 10)
    losses = []
    for i in range(6):
        model.p = schedule[min(i, 3)]  # a numpy scalar, changing, then held
        losses.append(step(torch.randn(4, 6, generator=g)))
    return _state(model, losses)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_numpy_scalar_attribute_is_keyed_not_restored_in_place(entry: str) -> None:
    torch.manual_seed(0)
    eager, model = ScheduledDrop(), ScheduledDrop()
    model.load_state_dict(eager.state_dict())
    reference = _scheduled(eager, _eager_step(eager))
    step, rec = ENTRIES[entry](model)
    replayed = _scheduled(model, step)
    assert _same(reference, replayed)
    assert rec.counts["replay"] >= 1, rec.summary()  # the held rate replays
    rec.release()


# --------------------------------------------------------------------------- sparse COO (a GNN)
def _adjacency(n: int = 8) -> torch.Tensor:
    idx = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 2], [1, 2, 3, 4, 5, 6, 7, 0, 4, 6]])
    return torch.sparse_coo_tensor(idx, torch.ones(10), (n, n)).coalesce()


class GCN(nn.Module):
    """Two graph convolutions, ``torch.sparse.mm(adj, x)``; the adjacency passed or held as a buffer."""

    def __init__(self, held: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)
        if held:
            self.register_buffer("adj", _adjacency())

    def forward(self, x: torch.Tensor, adj: torch.Tensor | None = None) -> torch.Tensor:
        adj = self.adj if adj is None else adj
        return self.out(torch.sparse.mm(adj, torch.relu(torch.sparse.mm(adj, self.lin(x)))))


def _graph_steps(model: GCN, step: Callable, passed: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    adj = _adjacency()
    losses = [step(torch.randn(8, 6, generator=g), *((adj,) if passed else ())) for _ in range(4)]
    return _state(model, losses)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("passed", [True, False], ids=["input", "buffer"])
def test_a_sparse_adjacency_runs_eagerly_with_a_reason(entry: str, passed: bool) -> None:
    """A sparse input routes eager (``sparse_input``: a graph's static inputs are dense buffers); a
    sparse buffer retires with the capture's reason. Neither crashes; both end as eager."""
    torch.manual_seed(0)
    eager, model = GCN(held=not passed), GCN(held=not passed)
    model.load_state_dict(eager.state_dict())
    reference = _graph_steps(eager, _eager_step(eager), passed)
    step, rec = ENTRIES[entry](model)
    replayed = _graph_steps(model, step, passed)
    assert _same(reference, replayed)
    if passed:
        assert rec.eager_reasons["sparse_input"] >= 3, rec.summary()
    else:
        assert rec.retired and "capture failed" in rec.retire_reason, rec.summary()
    rec.release()


# --------------------------------------------------------------------------- a capture that fails
def _eigh_syncing(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` as CUDA runs it: it reads its error code on the host, which a stream
    under capture refuses (the emulated tape reports capturing as a CUDA capture does)."""
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only torch outside a recording
        capturing = False
    if capturing:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    return torch.linalg.eigh(c)


class Whitened(nn.Module):
    """Decorrelated features (a whitening layer, as in a self-supervised loss), after dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.drop(self.lin(x))
        z = z - z.mean(0)
        evals, evecs = _eigh_syncing(z.T @ z / z.shape[0] + 1e-3 * torch.eye(4))
        return z @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T


def _whitened_steps(model: nn.Module, step: Callable) -> list[torch.Tensor]:
    torch.manual_seed(5)  # dropout's masks: the failed capture must leave the generator as eager's
    g = torch.Generator().manual_seed(4)
    losses = [step(torch.randn(16, 6, generator=g)) for _ in range(4)]
    return [*_state(model, losses), torch.rand(3)]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_capture_that_fails_retires_with_the_reason_and_leaves_eager_state(entry: str) -> None:
    """The CPU stand-in for ``torch.linalg.eigh`` failing inside a CUDA capture: the call that tried
    ends as eager's (parameters, optimizer state, the generator's draws), then eager with the reason."""
    torch.manual_seed(0)
    eager, model = Whitened(), Whitened()
    model.load_state_dict(eager.state_dict())
    reference = _whitened_steps(eager, _eager_step(eager))
    step, rec = ENTRIES[entry](model)
    replayed = _whitened_steps(model, step)
    assert _same(reference, replayed)
    assert rec.retired and "operation not permitted when stream is capturing" in rec.retire_reason
    rec.release()


# --------------------------------------------------------------------------- selective checkpointing
def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    policy = checkpointing.CheckpointPolicy
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return policy.MUST_SAVE if op in matmuls else policy.PREFER_RECOMPUTE


class SelectivelyCheckpointed(nn.Module):
    """A block under selective activation checkpointing: matmuls saved, the rest recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        contexts = functools.partial(
            checkpointing.create_selective_checkpoint_contexts, _save_matmuls
        )
        return self.head(
            checkpointing.checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)
        )


def _trained_as_eager(cls: type[nn.Module], entry: str) -> object:
    """Four steps of ``cls`` under ``entry`` end bitwise as the eager loop's: its recorder."""
    torch.manual_seed(0)
    eager, model = cls(), cls()
    model.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(6)
    batches = [torch.randn(4, 6, generator=g) for _ in range(4)]
    run = _eager_step(eager)
    reference = _state(eager, [run(x) for x in batches])
    step, rec = ENTRIES[entry](model)
    replayed = _state(model, [step(x) for x in batches])
    assert _same(reference, replayed)
    return rec


@pytest.mark.skipif(
    not hasattr(checkpointing, "CheckpointPolicy"), reason="selective checkpointing: torch>=2.5"
)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_selective_activation_checkpointing_ends_as_eager(entry: str) -> None:
    """Its cache allows one backward: the whole step (one backward per recording) replays; network
    replay, whose every backward differentiates the recorded graph again, retires at record."""
    rec = _trained_as_eager(SelectivelyCheckpointed, entry)
    if entry == "step":
        assert rec.counts["replay"] >= 1, rec.summary()
    else:  # torch >= 2.12 raises at the second backward; 2.11's second one reads other values
        assert rec.retired, rec.summary()
        assert any(m in rec.retire_reason for m in ("backward an extra time", "not repeatable"))
    rec.release()


class _PoppedCache(torch.autograd.Function):
    """Torch 2.11's selective checkpointing as a Function: the forward caches two outputs in a
    list each backward pops one of (2.11's early-stopped recompute pops one matmul of two), so
    the first backward is right, the second reads the other op's output, the third raises."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x @ w
        ctx.cache = [y.detach(), -y.detach()]  # type: ignore[attr-defined]
        ctx.save_for_backward(x, w)  # type: ignore[attr-defined]
        return y.relu()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not ctx.cache:  # type: ignore[attr-defined]
            raise RuntimeError("Trying to backward an extra time.")
        gy = g * (ctx.cache.pop(0) > 0)  # type: ignore[attr-defined]
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return gy @ w.T, x.T @ gy


class PoppedCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_PoppedCache.apply(x, self.w))


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_backward_that_consumes_its_cache_ends_as_eager_at_record(entry: str) -> None:
    """A graph that backwards correctly once, then differently, then raises (selective
    checkpointing on torch 2.11): network replay, whose every backward differentiates the
    recorded graph again, finds it at record and retires with a reason, never raising in the
    user's backward; the whole step (one backward per recording) replays."""
    rec = _trained_as_eager(PoppedCache, entry)
    if entry == "step":
        assert rec.counts["replay"] >= 1, rec.summary()
    else:
        assert rec.retired and "not repeatable" in rec.retire_reason, rec.summary()
    rec.release()


# --------------------------------------------------------------------------- lifetime
def test_a_released_step_of_a_transformers_model_lets_the_model_go() -> None:
    """A sweep of trials builds a model and a step per trial: after release and del, nothing of
    replaykit's (a cycle through autograd nodes, a registry) may keep the model alive."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    step = rk.TrainStep(
        model,
        lambda m, **b: m(**b).loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        backend="emulated",
    )
    ids = torch.randint(0, 32, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    for _ in range(3):
        loss = step(input_ids=ids, attention_mask=mask, labels=ids)
    assert step.counts["replay"] >= 1, step.summary()
    alive = weakref.ref(model)
    step.release()
    del step, model, loss
    gc.collect()
    assert alive() is None
