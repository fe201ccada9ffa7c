"""Loops that keep what they read of ``p.grad``, eager against replayed, call by call.

Eager's ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place and the next backward
accumulates into it; between a whole step's micro-batches ``.grad`` is one running sum. So
whatever a loop keeps of ``.grad`` (``g``, ``g.view(-1)``, ``g.data``) *is* the next gradient.
Each loop here records, after every call, what each kept tensor holds, whether it shares the
current ``.grad``'s memory and whether it is ``.grad``: :func:`same` compares two runs bitwise.
Used by ``tests/core/test_kept_grads.py`` and ``scripts/gpu/grad_alias_check.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

from .step_trial import SmallNet, small_loss

KEEP: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ref": lambda g: g,
    "view": lambda g: g.view(-1),
    "data": lambda g: g.data,
}
STEPS = 5

#: per kept tensor and call: its values, whether it shares .grad's memory, whether it is .grad
Seen = list[tuple[torch.Tensor, bool, bool]]


def look(kept: torch.Tensor | None, grad: torch.Tensor | None, seen: Seen) -> None:
    """What ``kept`` holds now, whether it shares ``grad``'s memory, whether it is ``grad``."""
    if kept is not None:
        same = grad is not None and kept.data_ptr() == grad.data_ptr()
        seen.append((kept.detach().cpu().clone().view(-1), same, kept is grad))


def same(eager: Seen, replay: Seen) -> bool:
    """Bitwise the same values, memory relation and identity at every call."""
    return len(eager) == len(replay) and all(
        torch.equal(a, b) and sa == sb and ia == ib
        for (a, sa, ia), (b, sb, ib) in zip(eager, replay, strict=True)
    )


def batches(device: str, n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(8, 8, generator=g).to(device),
            torch.randint(0, 4, (8,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def _optimizer(kind: str, params: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    if kind == "adamw":  # fused: its kernel reads every .grad at once
        return torch.optim.AdamW(params, lr=1e-3, fused=True, capturable=device == "cuda")
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def zero_in_place_loop(
    keep: str,
    device: str,
    backend: str | None,
    opt_step: dict | None = None,
    net: bool = True,
    optimizer: str = "sgd",
    amp: bool = False,
    rows: tuple[int, ...] = (8,),
    **kw: Any,
) -> tuple[Seen, list]:
    """``zero_grad(set_to_none=False)``, backward, the kept tensor read, then clip and step.
    ``backend`` None: eager. ``opt_step``: the step replayed by an ``OptimizerStep`` made with
    these arguments; ``net``: the network replayed (``rk.capture`` with ``kw``); ``amp``: autocast
    and a ``GradScaler`` (unscaling ``.grad`` in place); ``rows``: each batch's rows, in turn
    (several: a recording per signature). Returns what was seen and the entry points."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    params = list(model.parameters())
    opt = _optimizer(optimizer, params, device)
    entries: list = [rk.capture(model, backend=backend, **kw)] if backend and net else []
    if backend and opt_step is not None:
        entries.append(rk.OptimizerStep(opt, backend=backend, **opt_step))
    scaler = torch.amp.GradScaler(device) if amp else None
    dtype = torch.float16 if device == "cuda" else torch.bfloat16

    def body() -> None:
        if scaler is not None:
            scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(params, 0.5)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    seen: Seen = []
    kept = None
    for i, (x, y) in enumerate(batches(device)):
        n = rows[i % len(rows)]
        x, y = x[:n], y[:n]
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device, dtype=dtype) if amp else contextlib.nullcontext():
            loss = F.cross_entropy(model(x).float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        look(kept, model[0].weight.grad, seen)
        if backend and opt_step is not None:
            entries[-1](body, key=("norm", 0.5))
        else:
            body()
        kept = KEEP[keep](model[0].weight.grad)
    look(kept, model[0].weight.grad, seen)
    return seen, entries


def kept_after_set_to_none(device: str, backend: str | None) -> tuple[Seen, Any]:
    """``zero_grad(set_to_none=True)``, keeping every step's first-layer gradient as a view (a
    gradient-norm history): each kept view is a gradient of its own, read after every call.
    ``backend`` None: eager. Returns what was seen and the recorder (None: eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = _optimizer("sgd", list(model.parameters()), device)
    rec = rk.capture(model, backend=backend) if backend else None
    seen: Seen = []
    kept: list[torch.Tensor] = []
    for x, y in batches(device):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        kept.append(model[0].weight.grad.view(-1))
        for k in kept:
            look(k, model[0].weight.grad, seen)
    return seen, rec


def micro_batch_loop(
    keep: str, device: str, backend: str | None, accumulate: int, **kw: Any
) -> tuple[Seen, rk.TrainStep]:
    """A whole step over micro-batches (``backend`` None: its eager twin); after each call the
    tensors kept so far are read and the current ``.grad`` is kept."""
    torch.manual_seed(0)
    model = SmallNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = rk.TrainStep(
        model,
        small_loss,
        opt,
        accumulate=accumulate,
        replay=backend is not None,
        backend=backend or "emulated",
        **kw,
    )
    seen: Seen = []
    kept: list[torch.Tensor] = []
    for x, y in batches(device, 4 * accumulate):
        step(x, y)
        grad = model.head.weight.grad
        for k in kept:
            look(k, grad, seen)
        if grad is not None:
            kept.append(KEEP[keep](grad))
    return seen, step
