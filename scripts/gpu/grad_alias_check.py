"""Kept gradients (hostile round 4, cause 3): what a loop keeps of ``p.grad`` stays eager's.

    python scripts/gpu/grad_alias_check.py                 # cuda (the H200)
    python scripts/gpu/grad_alias_check.py --device cpu    # the emulated backend, same rows
    ... --without-swap     # as on a torch without UntypedStorage._swap_data_ptr_ (2.11)

One PASS/FAIL line per case, each under its own deadline (a hang is a FAIL, not a stuck run).
CUDA graphs' static gradient buffers are where this matters: a kept gradient still on one is
overwritten by the next replay. Cases (``replaykit.testing.parity.kept_grads``):

- ``rk.capture`` with ``zero_grad(set_to_none=False)``, keeping ``g`` / ``g.view(-1)`` /
  ``g.data`` (SGD with momentum; fused AdamW under autocast with a ``GradScaler``), the same with
  an ``OptimizerStep``, and ``rk.TrainStep`` keeping them between micro-batches: PASS needs the
  kept tensors' values, memory relation to ``.grad`` and identity bitwise eager's at every call,
  and replays where torch can move a held storage (2.12+); on a torch without (the H200's 2.11)
  a held view or ``.data`` is given away by ``rk.capture`` (recorded anew, then replayed:
  ``scripts/gpu/kept_grads_211.py`` checks that) and keeps ``TrainStep``'s calls eager with the
  reason ``live_alias`` (exact, said), a kept ``.grad`` alone still replays;
- the hazard catalogue's ``kept_grads`` patterns: the safe arm ends bitwise like eager (and
  replays where torch can move a held storage), the unsafe arm (``copy_out`` off) must diverge.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from functools import partial

import torch

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.memory.copy_out import holders_move
from replaykit.testing.hazards import by_hazard, run_pattern
from replaykit.testing.hazards.deadline import checked_row
from replaykit.testing.parity.kept_grads import (
    KEEP,
    micro_batch_loop,
    same,
    zero_in_place_loop,
)


def _determinism(device: str) -> None:
    if device == "cuda":
        from replaykit.verify.determinism import enable_determinism

        enable_determinism()


def _counted(entries: list, keep: str) -> tuple[bool, str]:
    """Replays as promised: an ``OptimizerStep`` copies into the parameters' own gradients and
    replays; copy-out's entry points replay where a held storage moves (or only ``.grad`` is
    kept), else they replay or run eagerly with the reason ``live_alias`` while a view or ``.data``
    of a handed-out gradient is held."""
    ok = True
    for e in entries:
        live = e.eager_reasons.get("live_alias", 0)
        if isinstance(e, rk.OptimizerStep) or holders_move() or keep == "ref":
            ok = ok and e.counts["replay"] > 0 and not live
        else:  # replayed (nothing static was ever held: .grad existed before), or said why not
            ok = ok and (e.counts["replay"] > 0 or live > 0)
    counts = [e.counts["replay"] for e in entries]
    return ok, f"replay {counts} eager {[dict(e.eager_reasons) for e in entries]}"


def _capture_case(keep: str, device: str, backend: str, **options) -> tuple[bool, str]:
    _determinism(device)
    eager, _ = zero_in_place_loop(keep, device, None, **options)
    replay, entries = zero_in_place_loop(keep, device, backend, **options)
    ok, detail = _counted(entries, keep)
    for e in entries:
        e.release()
    if not same(eager, replay):
        return False, f"DIFFERS from eager; {detail}"
    return ok, detail


def _step_case(keep: str, device: str, backend: str, accumulate: int) -> tuple[bool, str]:
    _determinism(device)
    eager, _ = micro_batch_loop(keep, device, None, accumulate)
    replay, step = micro_batch_loop(keep, device, backend, accumulate)
    ok, detail = _counted([step], keep)
    step.release()
    if not same(eager, replay):
        return False, f"DIFFERS from eager; {detail}"
    return ok, detail


def _pattern_case(name: str, unsafe: bool, backend: str, timeout: float) -> tuple[bool, str]:
    [pattern] = [p for p in by_hazard("kept_grads") if p.name == name]
    outcome = run_pattern(pattern, backend, unsafe=unsafe, timeout=timeout)
    if unsafe:
        return outcome.diverged, outcome.line()
    replayed = outcome.kind.startswith("replayed") or not holders_move()
    return replayed and not outcome.failed, outcome.line()


def _run(label: str, fn: Callable[[], tuple[bool, str]], timeout: float) -> bool:
    return checked_row(label, fn, timeout, 52)


def _cases(device: str, backend: str, timeout: float) -> list[tuple[str, Callable, float]]:
    cases: list[tuple[str, Callable, float]] = []
    for keep in KEEP:
        for label, options in (
            ("capture sgd", {}),
            ("capture adamw+amp", {"optimizer": "adamw", "amp": True}),
            ("capture+OptimizerStep", {"opt_step": {}}),
            ("OptimizerStep alone", {"opt_step": {}, "net": False}),
        ):
            fn = partial(_capture_case, keep, device, backend, **options)
            cases.append((f"{label} keep {keep}", fn, timeout))
        for accumulate in (2, 3):
            fn = partial(_step_case, keep, device, backend, accumulate)
            cases.append((f"TrainStep accumulate={accumulate} keep {keep}", fn, timeout))
    for pattern in by_hazard("kept_grads"):
        for unsafe in (False, True) if pattern.guard else (False,):
            fn = partial(_pattern_case, pattern.name, unsafe, backend, timeout)
            cases.append((f"{pattern.name}{' (unsafe)' if unsafe else ''}", fn, timeout + 30))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    parser.add_argument(
        "--without-swap", action="store_true", help="as on a torch that cannot move a storage"
    )
    args = parser.parse_args(argv)
    if args.without_swap:
        copy_out._swap = None
    warnings.simplefilter("ignore")
    backend = "cuda" if args.device == "cuda" else "emulated"
    print(
        f"torch {torch.__version__}  backend {backend}  held storages move: {holders_move()} "
        "(False: a held view or .data keeps its calls eager)"
    )
    results = [_run(label, fn, t) for label, fn, t in _cases(args.device, backend, args.timeout)]
    print(f"{sum(results)}/{len(results)} PASS")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
