"""OptimizerStep: the optimizer step alone (clip, scaler, update) replayed, bitwise equal to eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.optimizer_step import OptimizerStep
from replaykit.protections import negative_control


def _train(
    replay: bool,
    *,
    backend: str = "emulated",
    unsafe: tuple[str, ...] = (),
    optimizer: str = "sgd",
    clip: str | None = "norm",
    lr_at: dict[int, float] | None = None,
    reload_at: int | None = None,
    steps: int = 6,
) -> tuple[nn.Module, OptimizerStep | None, list[torch.Tensor]]:
    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    else:
        lr = torch.tensor(0.01, device=device)
        opt = torch.optim.AdamW(net.parameters(), lr=lr, fused=True, capturable=device == "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = OptimizerStep(opt, unsafe_disable=unsafe, backend=backend) if replay else None
    g = torch.Generator().manual_seed(1)
    held = []
    for i in range(steps):
        if lr_at and i in lr_at:
            for group in opt.param_groups:
                group["lr"] = lr_at[i]
        if reload_at == i:  # a checkpoint loaded mid-run: new state tensors
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt.zero_grad()
        net(torch.randn(5, 8, generator=g).to(device)).pow(2).sum().backward()

        def body() -> None:
            if clip == "norm":
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            elif clip == "value":
                nn.utils.clip_grad_value_(net.parameters(), 0.01)
            opt.step()

        if step is None:
            body()
        else:
            step(body, (clip,))
        held.append(net[0].weight.grad)  # a gradient held past its step keeps its values
    net.optimizer_state = [t for s in opt.state.values() for t in s.values()]
    return net, step, held


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    ) and all(
        torch.equal(x, y)
        for x, y in zip(
            [*(p.grad for p in a.parameters()), *a.optimizer_state],
            [*(p.grad for p in b.parameters()), *b.optimizer_state],
            strict=True,
        )
    )


@pytest.mark.parametrize(
    "optimizer,clip", [("sgd", "norm"), ("sgd", "value"), ("adamw", None), ("adamw", "norm")]
)
def test_replayed_optimizer_step_equals_eager(
    optimizer: str, clip: str | None, backend: str
) -> None:
    """Clipping writes the gradients in place (``_foreach_mul_``): by design, not a lost write."""
    eager, _, held_e = _train(False, optimizer=optimizer, clip=clip, backend=backend)
    mine, step, held_r = _train(True, optimizer=optimizer, clip=clip, backend=backend)
    assert step is not None and step.counts["replay"] == 4 and step.counts["record"] == 1
    assert _equal(eager, mine)
    assert all(torch.equal(a, b) for a, b in zip(held_e, held_r, strict=True))


def test_without_grad_inputs_the_replay_reads_the_recording_calls_gradients(backend: str) -> None:
    eager, _, _ = _train(False, backend=backend)
    mine, step, _ = _train(True, unsafe=negative_control("grad_inputs"), backend=backend)
    assert step is not None and step.counts["replay"] == 4
    assert not _equal(eager, mine)


def test_a_float_lr_changed_records_anew_and_diverges_unkeyed(backend: str) -> None:
    lr_at = {3: 0.05, 4: 0.02}
    eager, _, _ = _train(False, lr_at=lr_at, backend=backend)
    mine, step, _ = _train(True, lr_at=lr_at, backend=backend)
    assert step is not None and step.counts["record"] == 3 and _equal(eager, mine)
    unsafe, step, _ = _train(
        True, lr_at=lr_at, unsafe=negative_control("host_values"), backend=backend
    )
    assert step is not None and step.counts["record"] == 1 and not _equal(eager, unsafe)


def test_reloaded_optimizer_state_records_anew_and_diverges_unwatched(backend: str) -> None:
    eager, _, _ = _train(False, reload_at=3, backend=backend)
    mine, step, _ = _train(True, reload_at=3, backend=backend)
    assert step is not None and step.counts["rerecord"] == 1 and _equal(eager, mine)
    assert step.counts["replay"] >= 1
    unsafe, step, _ = _train(
        True, reload_at=3, unsafe=negative_control("state_identity"), backend=backend
    )
    assert step is not None and not _equal(eager, unsafe)


def test_refusals_and_bad_input() -> None:
    with pytest.raises(rk.ReplayError, match=r"torch\.optim\.Optimizer"):
        OptimizerStep(object())  # type: ignore[arg-type]
    with pytest.raises(rk.ReplayError, match="unknown unsafe_disable"):
        OptimizerStep(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), unsafe_disable="hold")
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=torch.tensor(0.1))  # a tensor lr read on the host
    step = OptimizerStep(opt, warmup=0)
    p.grad = torch.ones(2)
    step(opt.step)
    assert step.counts["replay"] == 0 and "tensor lr" in next(iter(step.eager_reasons))


def _rebinding(
    replay: bool, backend: str, unsafe: tuple[str, ...] = ()
) -> tuple[list[torch.Tensor], OptimizerStep | None]:
    """A step body that scales gradients by assigning new tensors (``p.grad = p.grad * 0.5``)."""
    torch.manual_seed(0)
    device = "cuda" if backend == "cuda" else "cpu"
    net = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = OptimizerStep(opt, unsafe_disable=unsafe, backend=backend) if replay else None
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        opt.zero_grad()
        net(torch.randn(3, 4, generator=g).to(device)).pow(2).sum().backward()

        def body() -> None:
            for p in net.parameters():
                p.grad = p.grad * 0.5
            opt.step()

        body() if step is None else step(body)
    return [*net.parameters(), *(p.grad for p in net.parameters())], step


def test_a_body_assigning_new_gradients_retires_and_stays_exact(backend: str) -> None:
    """grad_inputs copies the step's values back into the buffers it recorded with; a gradient the
    body rebinds is another tensor: the parameters' .grad kept the unscaled values, silently."""
    eager, _ = _rebinding(False, backend)
    mine, step = _rebinding(True, backend)
    assert step is not None and step.retired and "new .grad" in step.retire_reason
    assert all(torch.equal(a, b) for a, b in zip(eager, mine, strict=True))
    try:
        unsafe, step = _rebinding(True, backend, negative_control("grad_rebind"))
    except RuntimeError as e:  # torch 2.4: the tape's static gradient is freed under it, loudly
        if torch.torch_version.TorchVersion(torch.__version__) >= "2.5" or "storage" not in str(e):
            raise
        return
    assert step is not None and step.counts["replay"] > 0
    assert not all(torch.equal(a, b) for a, b in zip(eager, unsafe, strict=True))
