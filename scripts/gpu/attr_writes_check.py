"""Tensor attributes a forward assigns (issue #35): an MoE aux_loss, attention kept for logging.

    python scripts/gpu/attr_writes_check.py                      # cuda (the H200)
    python scripts/gpu/attr_writes_check.py --backend emulated   # the CPU, same rows

One PASS/FAIL line per case, each under its own deadline (a hang is a FAIL, not a stuck run):

- loops under ``rk.capture`` against the same loop run eagerly, compared after every call
  (loss, every ``.grad`` and its None pattern, every tensor attribute with its ``requires_grad``
  and ``grad_fn`` pattern) and at the end (parameters): PASS needs bitwise equality and at least
  three replays (the running centre, a forward reading what it assigns, too: a state read from a
  slot); ``(unsafe)`` rows switch ``attribute_outputs`` off and must differ or raise;
- the hazard catalogue's patterns about assigned attributes: safe arms must not fail (and
  replay where the catalogue says they do), unsafe arms must diverge;
- one timing row (not a PASS criterion): ms per training step of a wider MoE, eager and replayed.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control
from replaykit.testing.hazards import pattern, run_pattern
from replaykit.testing.hazards.deadline import checked_row
from replaykit.testing.hazards.side_effects import (
    FirstBatchCentre,
    KeepsOutput,
    LoggedAttention,
    MoE,
    MoEStack,
)

LOOPS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor] | None]] = {
    "moe_aux_loss_in_the_loss": (MoE, lambda m: m.aux_loss),
    "moe_aux_loss_unused": (MoE, None),
    "last_attn_detached": (LoggedAttention, None),
    "nested_moe_and_attention": (MoEStack, lambda m: m.a.aux_loss + m.b.aux_loss),
    "attribute_is_the_output": (KeepsOutput, lambda m: m.last.sum()),
    "running_centre_state": (FirstBatchCentre, None),
}
PATTERNS = (
    "moe_aux_loss_attribute",
    "moe_aux_loss_logged",
    "attention_kept_for_logging",
    "moe_stack_aux_losses",
    "output_kept_on_module",
    "centre_from_first_batch",
    "tensor_attribute_updated",
    "rebound_centre_buffer",
    "step_moe_aux_loss_attribute",
)
REPLAYING = {
    "moe_aux_loss_attribute",
    "moe_aux_loss_logged",
    "attention_kept_for_logging",
    "moe_stack_aux_losses",
    "output_kept_on_module",
    "centre_from_first_batch",
    "tensor_attribute_updated",
    "rebound_centre_buffer",
}


def _seen(model: nn.Module, loss: torch.Tensor) -> list:
    """What one call leaves: the loss, each .grad (None kept), each tensor attribute."""
    attrs = [
        (f"{n}.{k}", v.detach().cpu().clone(), v.requires_grad, v.grad_fn is None)
        for n, m in model.named_modules()
        for k, v in m.__dict__.items()
        if isinstance(v, torch.Tensor)
    ]
    grads = [None if p.grad is None else p.grad.cpu().clone() for p in model.parameters()]
    return [loss.detach().cpu(), grads, attrs]


def _train(name: str, device: str, backend: str | None, unsafe: tuple[str, ...] = ()) -> tuple:
    make, extra = LOOPS[name]
    torch.manual_seed(0)
    model = make().to(device)
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(8):
        opt.zero_grad(set_to_none=True)
        out = model(torch.randn(4 + step % 2, 6, device=device))
        if name == "attribute_is_the_output" and model.last is not out:
            raise AssertionError(f"call {step + 1}: model.last is not the output")
        loss = out.pow(2).mean() + (0.1 * extra(model) if extra is not None else 0.0)
        loss.backward()
        seen.append(_seen(model, loss))
        opt.step()
    seen.append([p.detach().cpu().clone() for p in model.parameters()])
    return seen, rec


def _differs(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return not (both and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return a != b


def _loop_case(name: str, device: str, backend: str, unsafe: bool) -> tuple[bool, str]:
    eager, _ = _train(name, device, None)
    off = negative_control("attribute_outputs") if unsafe else ()
    try:
        replayed, rec = _train(name, device, backend, off)
    except RuntimeError as exc:  # the unsafe MoE reaches the first call's freed graph
        return unsafe, f"raised {type(exc).__name__}: {str(exc)[:100]}"
    first = next(
        (i + 1 for i, (a, b) in enumerate(zip(eager, replayed, strict=True)) if _differs(a, b)),
        None,
    )
    detail = f"record {rec.counts['record']} replay {rec.counts['replay']} eager {dict(rec.eager_reasons)}"
    if rec.retire_reason:
        detail += f" retired: {rec.retire_reason[:70]}"
    rec.release()
    if unsafe:
        return first is not None, f"differs from call {first}; {detail}"
    if first is not None:
        return False, f"DIFFERS at call {first}; {detail}"
    return rec.counts["replay"] >= 3, detail


def _pattern_case(name: str, unsafe: bool, backend: str, timeout: float) -> tuple[bool, str]:
    outcome = run_pattern(pattern(name), backend, unsafe=unsafe, timeout=timeout)
    if unsafe:
        return outcome.diverged, outcome.line()
    replays = outcome.kind.startswith("replayed")
    return not outcome.failed and (replays or name not in REPLAYING), outcome.line()


def _timing(device: str, backend: str) -> tuple[bool, str]:
    """ms per step of a wider MoE (256 wide, batch 64), eager then replayed: information only."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(256, 4)
            self.experts = nn.ModuleList([nn.Linear(256, 256) for _ in range(4)])
            self.aux_loss = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(self.gate(x), dim=1)
            self.aux_loss = 4 * probs.mean(0).pow(2).sum()
            return sum(probs[:, i : i + 1] * e(x) for i, e in enumerate(self.experts))

    ms = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = Wide().to(device)
        rec = rk.capture(model, backend=backend) if replay else None
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 256, device=device)
        for i in range(60):
            if i == 20:
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            (model(x).pow(2).mean() + 0.1 * model.aux_loss).backward()
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) / 40 * 1e3)
        if rec is not None:
            replays = rec.counts["replay"]
            rec.release()
    return True, f"INFO eager {ms[0]:.3f} ms/step, replayed {ms[1]:.3f} ms/step ({replays} replays)"


def _run(label: str, fn: Callable[[], tuple[bool, str]], timeout: float) -> bool:
    return checked_row(label, fn, timeout, 44)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=["cuda", "emulated"])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    device = "cuda" if args.backend == "cuda" else "cpu"
    if device == "cuda":
        rk.enable_determinism()
    print(f"torch {torch.__version__}  backend {args.backend}")
    results = []
    for name in LOOPS:
        for unsafe in (
            (False, True)
            if name in ("moe_aux_loss_in_the_loss", "last_attn_detached")
            else (False,)
        ):
            label = f"{name}{' (unsafe)' if unsafe else ''}"
            case = partial(_loop_case, name, device, args.backend, unsafe)
            results.append(_run(label, case, args.timeout))
    for name in PATTERNS:
        for unsafe in (False, True):
            label = f"{name}{' (unsafe)' if unsafe else ''}"
            case = partial(_pattern_case, name, unsafe, args.backend, args.timeout)
            results.append(_run(label, case, args.timeout + 30))
    _run(
        "timing: wide MoE, aux_loss in the loss",
        partial(_timing, device, args.backend),
        args.timeout,
    )
    print(f"{sum(results)}/{len(results)} PASS")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
