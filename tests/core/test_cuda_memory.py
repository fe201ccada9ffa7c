"""CUDA only: a released or retired recorder gives its graphs' memory back; a pool stays usable."""

from __future__ import annotations

import gc

import pytest
import torch

import replaykit as rk
from replaykit.backends import workspaces
from replaykit.testing.nets import DetectionNet


@pytest.mark.parametrize("end", ["release", "retire"])
def test_memory_returns_to_baseline(cuda_device: str, end: str) -> None:
    torch.manual_seed(0)
    model = DetectionNet().to(cuda_device)
    x = torch.randn(8, 3, 16, 16, device=cuda_device)
    gc.collect()
    # cuBLAS workspaces an earlier test's eager matmuls left (32 MiB each on the H200): a capture
    # clears them, so a baseline with them in it fell below itself (seen after the host-feed tests)
    workspaces.clear()
    baseline = torch.cuda.memory_allocated()
    rec = rk.capture(model)
    for i in range(4):
        y = x if i % 2 else x[:4]  # two recordings in the shared pool
        sum(o.square().mean() for o in model(y).values()).backward()
    assert rec.recordings == 2 and torch.cuda.memory_allocated() > baseline
    model.zero_grad(set_to_none=True)
    if end == "retire":
        rec.retire("test")
        model(x)  # eager, output dropped
    rec.release()
    del rec
    gc.collect()
    workspaces.clear()  # the retire arm's eager call may have made one
    assert torch.cuda.memory_allocated() == baseline


def test_a_pool_whose_only_graph_was_freed_takes_the_next_capture(cuda_device: str) -> None:
    """Seen on the H200 ("use_count > 0 INTERNAL ASSERT"): a step's only recording dropped (a key
    refused as diverged) while its output lived on left the pool with no graph; the next key's
    capture into it failed and the step retired. The pool's anchor keeps it open."""
    from replaykit.backends.cuda import CudaBackend

    backend = CudaBackend(torch.device(cuda_device))
    x = torch.arange(4.0, device=cuda_device)
    first = backend.region([x])
    kept = first.capture(lambda: [x * 2])[0]  # a handed-out output the user still holds
    first.free()
    second = backend.region([x])
    out = second.capture(lambda: [x + 1])[0]  # raised before the anchor
    assert torch.equal(out, x + 1) and torch.equal(kept, x * 2)
    second.free()


def _peak_allocated(step, x: torch.Tensor, above_start: bool = True) -> int:
    """Bytes allocated at the peak of one call, above what was allocated before it
    (``above_start=False``: everything held included)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if above_start else 0
    torch.cuda.reset_peak_memory_stats()
    step(x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_the_recording_call_needs_no_more_memory_than_an_eager_step(cuda_device: str) -> None:
    """A capture under a dispatch mode keeps one more activation alive at the backward's peak,
    and the pool keeps that size for good: the whole step captures unwatched (a capture that fails
    on a host read is captured again, watched). Activations of 32 MiB each dominate here."""
    torch.manual_seed(0)
    model = DetectionNet(width=64, depth=4).to(cuda_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(32, 3, 64, 64, device=cuda_device)

    def loss_fn(m, x):
        return sum(o.square().mean() for o in m(x).values())

    def eager(x):
        loss_fn(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    eager(x)
    eager_peak = _peak_allocated(eager, x)
    step = rk.TrainStep(model, loss_fn, opt)
    step(x)  # warm-up
    recording_peak = _peak_allocated(step, x)
    assert step.counts["record"] == 1, step.summary()
    activation = 32 * 64 * 64 * 64 * 4
    assert recording_peak < eager_peak + activation // 2, (recording_peak, eager_peak)


def _reserved_now() -> int:
    """Bytes the caching allocator holds once its free cached blocks are given back."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _mlp(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(device)


def _peak_reserved(run) -> int:
    """Bytes reserved at the peak of ``run()``, above what was reserved before it; cuBLAS's
    workspaces are dropped first, so the run pays for every one it makes."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    base = _reserved_now()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() - base


def test_a_whole_step_keeps_no_cublas_workspace_beside_eagers(cuda_device: str) -> None:
    """cuBLAS keeps a workspace (64 MiB on the H200) per stream that ran a matmul; a warm-up's
    side stream and the capture stream kept one each for good, three times eager's own for a
    small model. Each capture now makes its own in its pool, as scratch."""
    xs = [torch.randn(32, 64, device=cuda_device) for _ in range(6)]
    ys = [torch.randint(0, 10, (32,), device=cuda_device) for _ in range(6)]

    def loss_fn(m, x, y):
        return torch.nn.functional.cross_entropy(m(x), y)

    def eager_run() -> None:
        model = _mlp(cuda_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in zip(xs, ys, strict=True):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    counts = {}

    def step_run() -> None:
        model = _mlp(cuda_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = rk.TrainStep(model, loss_fn, opt)
        for x, y in zip(xs, ys, strict=True):
            step(x, y)
        counts.update(step.counts)
        step.release()

    eager, replayed = _peak_reserved(eager_run), _peak_reserved(step_run)
    assert counts["replay"] >= 3
    assert replayed <= eager + 16 * 2**20, (replayed / 2**20, eager / 2**20)


def test_recordings_of_new_signatures_add_no_cublas_workspaces(cuda_device: str) -> None:
    """Each recording warmed up on a new side stream, and each such stream kept a cuBLAS
    workspace for good: the reserved memory grew by 64 MiB (H200) per signature."""
    model = _mlp(cuda_device)
    rec = rk.capture(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(batch: int) -> None:
        for _ in range(4):
            model(torch.randn(batch, 64, device=cuda_device)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    train(8)
    one = _reserved_now()
    for batch in (16, 24, 32):
        train(batch)
    assert rec.recordings == 4 and rec.counts["replay"] >= 4
    grown = _reserved_now() - one
    assert grown < 32 * 2**20, grown / 2**20


def test_new_shape_buckets_verify_inside_the_pool(cuda_device: str) -> None:
    """Each new bucket's recording call runs an eager reference step; beside the pool it needed
    a step's worth of memory more (8 buckets: 1.92x eager's peak reserved on the H200, 848bf78).
    It now runs in the pool's free memory."""
    from replaykit.testing.bench import buckets as B

    results = B.bench(4, device=cuda_device, steps=16, arms=("eager", "TrainStep"))
    eager, step = results
    assert step.equals_eager and "records=4" in step.note, step.note
    assert step.peak_reserved_mib <= 1.2 * eager.peak_reserved_mib, (
        step.peak_reserved_mib,
        eager.peak_reserved_mib,
    )


def test_a_tensor_the_reference_step_leaves_in_the_pool_frees_the_earlier_recordings(
    cuda_device: str,
) -> None:
    """A per-length table cached globally at a new length's recording call lives in the pool: an
    earlier length's replay would overwrite it. The earlier recordings are freed (and recorded
    again), and the run stays bitwise."""
    import warnings

    from replaykit.testing.hazards.side_effects import CachedPositions, _positions

    runs = []
    for replay in (False, True):
        _positions.cache_clear()
        torch.manual_seed(0)
        model = CachedPositions().to(cuda_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step = rk.TrainStep(model, lambda m, x: m(x).pow(2).mean(), opt, warmup=1, replay=replay)
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = [step(torch.randn(n, 6, device=cuda_device)) for n in (4, 4, 4, 6, 4, 6, 4, 6)]
        runs.append((losses, model, step))
    (l0, m0, _), (l1, m1, step) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters(), strict=True))
    refused = [e for e in step.journal if e.kind == "refuse" and e.reason == "pool_survivors"]
    assert len(refused) == 1 and step.counts["replay"] >= 2, step.summary()


def test_a_recording_call_keeps_no_copy_of_the_training_state_on_the_gpu(cuda_device: str) -> None:
    """A recording call snapshots the state and keeps the reference step's end state (the
    parameters, gradients and momentum: here 3 x 64 MiB) while the capture runs: on the GPU that
    added up to 2.6x an eager step's peak for a model whose state dominates (a fine-tune at a small
    batch). The copies are kept in host memory."""
    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
    ).to(cuda_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(8, width, device=cuda_device)

    def loss_fn(m, x):
        return m(x).square().mean()

    def eager(x):
        loss_fn(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    eager(x)
    eager_peak = _peak_allocated(eager, x, above_start=False)
    step = rk.TrainStep(model, loss_fn, opt)
    step(x)  # warm-up
    recording_peak = _peak_allocated(step, x, above_start=False)
    assert step.counts["record"] == 1, step.summary()
    assert recording_peak <= 1.15 * eager_peak, (recording_peak / 2**20, eager_peak / 2**20)
