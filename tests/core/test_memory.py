"""Memory: what each recording holds (``memory()``), shape buckets that record once each, and a
pool shared by several entry points (``rk.MemoryPool``), safe or routed eager (``pool_busy``).

On the emulated backend a claim of a shared pool overwrites the other entry points' static
outputs and gradients (what a CUDA replay in the same pool may do), so the protection's unsafe
arm diverges on a CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.protections import negative_control
from replaykit.testing.bench.buckets import lm_loss, padded_batches
from replaykit.testing.zoo.language import TinyLM


def _lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab=256, context=16, dim=16, layers=1, heads=2)


def _train(model, steps, batches):
    losses = [steps(tokens, labels) for tokens, labels in batches]
    return losses, {k: v.cpu().clone() for k, v in model.state_dict().items()}


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_bucket_records_once_and_replays_bitwise(backend, device):
    """A Hugging Face style loop: lengths padded to 4 buckets; one recording per bucket, the rest replay."""
    batches = padded_batches(20, 2, (4, 8, 12, 16), torch.device(device))
    runs = []
    for replay in (False, True):
        model = _lm().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = rk.TrainStep(model, lm_loss, opt, replay=replay, backend=backend)
        torch.manual_seed(1)
        runs.append((*_train(model, step, batches), step))
    (l0, s0, _), (l1, s1, step) = runs
    assert step.counts["record"] == 4, step.summary()
    assert step.counts["replay"] == 20 - 4 - 1, step.summary()  # the first call warms up
    assert dict(step.eager_reasons) == {"warmup": 1}
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert _equal(s0, s1)


def test_memory_reports_the_bytes_each_recording_holds():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(model, lambda m, x: m(x).square().mean(), opt, backend="emulated", warmup=0)
    assert step.memory() == {"recordings": [], "static_bytes": 0, "pool_reserved": None}
    step(torch.randn(4, 8))
    step(torch.randn(6, 8))
    report = step.memory()
    rows = report["recordings"]
    for row, batch in zip(rows, (4, 6), strict=True):  # an aligned copy: its slack counts too
        assert batch * 8 * 4 <= row["static_inputs"] < batch * 8 * 4 + 1024
    assert all(r["static_outputs"] == 4 for r in rows)  # the loss: one float
    assert report["static_bytes"] == sum(r["bytes"] for r in rows)

    rec_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with rk.capture(rec_model, backend="emulated") as rec:
        rec_model(torch.randn(5, 8)).sum().backward()
        (row,) = rec.memory()["recordings"]
    params = sum(p.numel() * 4 for p in rec_model.parameters())
    inputs = row["static_inputs"]  # an aligned copy, as the whole step's: its slack counts too
    assert 5 * 8 * 4 <= inputs < 5 * 8 * 4 + 1024
    assert row == {
        "signature": "5/8",
        "static_inputs": inputs,
        "static_outputs": 5 * 4 * 4,
        "static_grads": params,
        "bytes": inputs + 5 * 4 * 4 + params,
    }


def _two_steps(pool, unsafe=(), backend="emulated", device="cpu"):
    """Two models trained by two TrainSteps (accumulation 2) in one pool, micro-batches interleaved
    every other step: one step's accumulation is under way while the other runs."""
    models, steps = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        models.append(model)
        steps.append(
            rk.TrainStep(
                model,
                lambda m, x: m(x).square().mean(),
                opt,
                accumulate=2,
                backend=backend,
                warmup=1,
                pool=pool or None,
                replay=pool is not False,
                unsafe_disable=unsafe,
            )
        )
    g = torch.Generator().manual_seed(3)
    for i in range(8):
        xs = [torch.randn(4, 6, generator=g).to(device) for _ in range(4)]
        if i % 2:  # one after the other
            steps[0](xs[0])
            steps[0](xs[3])
            steps[1](xs[1])
            steps[1](xs[2])
            continue
        steps[0](xs[0])  # a's first micro-batch: its static gradient buffers are .grad now
        steps[1](xs[1])
        steps[1](xs[2])
        steps[0](xs[3])
    return [{k: v.cpu() for k, v in m.state_dict().items()} for m in models], steps


def test_a_shared_pool_routes_eager_while_another_step_accumulates(backend, device):
    eager, _ = _two_steps(False, (), backend, device)
    shared, steps = _two_steps(rk.MemoryPool(), (), backend, device)
    assert all(_equal(a, b) for a, b in zip(eager, shared, strict=True))
    assert steps[1].eager_reasons["pool_busy"] > 0, steps[1].summary()
    assert steps[0].counts["replay"] > 0 and steps[1].counts["replay"] > 0


def test_without_the_shared_pool_protection_a_step_reads_overwritten_gradients():
    """The negative control: the other step's replay overwrites gradients still accumulating."""
    eager, _ = _two_steps(False)
    with pytest.warns(rk.ReplayWarning):
        shared, _ = _two_steps(rk.MemoryPool(), negative_control("shared_pool"))
    assert not all(_equal(a, b) for a, b in zip(eager, shared, strict=True))


def _two_recorders(pool, unsafe=(), backend="emulated", device="cpu"):
    """An encoder's output kept while a second captured module trains a full step in the same pool."""
    torch.manual_seed(0)
    enc, head = nn.Linear(6, 6).to(device), nn.Linear(6, 2).to(device)
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(device)
    params = [*enc.parameters(), *head.parameters(), *other.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    recorders = []
    if pool is not False:
        for m in (enc, other):
            recorders.append(rk.capture(m, backend=backend, pool=pool, unsafe_disable=unsafe))
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        h = enc(torch.randn(3, 6, generator=g).to(device))  # held across the other module's step
        other(torch.randn(2, 4, generator=g).to(device)).sum().backward()
        head(h).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().cpu().clone() for p in params], recorders


def test_a_shared_pool_keeps_a_pending_backward_of_another_recorder(backend, device):
    eager, _ = _two_recorders(False, (), backend, device)
    shared, (enc, other) = _two_recorders(rk.MemoryPool(), (), backend, device)
    assert all(torch.equal(a, b) for a, b in zip(eager, shared, strict=True))
    assert other.eager_reasons["pool_busy"] > 0, other.summary()
    assert enc.counts["replay"] > 0


@pytest.mark.skipif(
    not copy_out.holders_move(),
    reason="this torch hands out copies of outputs: a held output never shares the pool",
)
def test_without_the_shared_pool_protection_a_held_output_is_overwritten():
    eager, _ = _two_recorders(False)
    with pytest.warns(rk.ReplayWarning):
        shared, _ = _two_recorders(rk.MemoryPool(), negative_control("shared_pool"))
    assert not all(torch.equal(a, b) for a, b in zip(eager, shared, strict=True))


def test_pool_takes_a_memory_pool_only():
    with pytest.raises(rk.ReplayError, match="MemoryPool"):
        rk.capture(nn.Linear(2, 2), backend="emulated", pool="shared")
