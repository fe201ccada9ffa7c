"""Kept gradients on a torch without the storage swap (the H200's 2.11, Colab's): given away, then replayed.

    python scripts/gpu/kept_grads_211.py                 # cuda (the H200)
    python scripts/gpu/kept_grads_211.py --device cpu    # the emulated backend: a dry run, same rows

Without ``UntypedStorage._swap_data_ptr_`` a ``.grad`` on a recording's static buffer that a
view or ``.data`` also holds cannot move; ``rk.capture`` gives it to the caller, drops every
recording and records anew (journal ``rerecord``, ``grads_given_away``), and the later calls
replay. The script always runs as on such a torch (``copy_out._swap`` set to None: a no-op on
2.11), one PASS/FAIL row per case under its own deadline (a hang is a FAIL, not a stuck run).
PASS needs bitwise eager (values, memory relation to ``.grad``, identity, at every call) and:

- the catalogue's ``kept_grads`` capture patterns replayed after one give-away, no eager call;
  the step pattern exact (``TrainStep`` keeps routing ``live_alias``: a new ``.grad`` every
  accumulation cycle is a static buffer again); each unsafe arm (``copy_out`` off) diverged;
- ``rk.capture`` loops keeping ``g`` / ``g.view(-1)`` / ``g.data`` (SGD; fused AdamW under
  autocast with a ``GradScaler``; with an ``OptimizerStep``): replayed, one give-away where a
  view or ``.data`` is held;
- two batch shapes (every recording dropped at the give-away: on CUDA the other signature's
  graph could reuse the given block), ``zero_grad(set_to_none=True)`` (not given away:
  ``live_alias``), a ``MemoryPool`` another entry point shares (not given away) or not.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.testing.hazards import by_hazard, run_pattern
from replaykit.testing.hazards.deadline import checked_row
from replaykit.testing.parity.kept_grads import (
    STEPS,
    kept_after_set_to_none,
    same,
    zero_in_place_loop,
)

GIVEN = "grads_given_away"


def _determinism(device: str) -> None:
    if device == "cuda":
        from replaykit.verify.determinism import enable_determinism

        enable_determinism()


def _counts(e: Any) -> str:
    c = e.counts
    eager = dict(e.eager_reasons)
    return f"rec {c['record']} rep {c['replay']} rerecord {c['rerecord']} eager {eager or 0}"


def _given_then_replayed(e: Any, replays: int) -> bool:
    """One give-away, then every later call replayed (no eager call but a first use's)."""
    eager = {r: n for r, n in e.eager_reasons.items() if r != "first_use"}
    rerecords = [ev.reason for ev in e.journal if ev.kind == "rerecord"]
    return rerecords == [GIVEN] and not eager and e.counts["replay"] >= replays


def _capture_case(keep: str, device: str, backend: str, **options: Any) -> tuple[bool, str]:
    _determinism(device)
    eager, _ = zero_in_place_loop(keep, device, None, **options)
    replay, entries = zero_in_place_loop(keep, device, backend, **options)
    net = entries[0] if options.get("net", True) else None
    if "amp" in options:  # autocast's first call runs eagerly (first_use): .grad is eager's then
        ok = all(e.counts["replay"] > 0 and not e.eager_reasons["live_alias"] for e in entries)
    elif net is None or keep == "ref":  # nothing held beside .grad: replays, nothing given away
        ok = all(e.counts["replay"] > 0 and not e.counts["rerecord"] for e in entries)
    else:
        ok = _given_then_replayed(net, STEPS - 2)
        ok = ok and all(e.counts["replay"] > 0 for e in entries)
    detail = "; ".join(_counts(e) for e in entries)
    for e in entries:
        e.release()
    return (False, f"DIFFERS from eager; {detail}") if not same(eager, replay) else (ok, detail)


def _two_shapes(device: str, backend: str) -> tuple[bool, str]:
    _determinism(device)
    eager, _ = zero_in_place_loop("view", device, None, rows=(8, 6))
    replay, (rec,) = zero_in_place_loop("view", device, backend, rows=(8, 6))
    ok = _given_then_replayed(rec, STEPS - 3) and rec.counts["record"] == 3
    detail = _counts(rec)
    rec.release()
    return (False, f"DIFFERS from eager; {detail}") if not same(eager, replay) else (ok, detail)


def _set_to_none(device: str, backend: str) -> tuple[bool, str]:
    _determinism(device)
    eager, _ = kept_after_set_to_none(device, None)
    replay, rec = kept_after_set_to_none(device, backend)
    ok = rec.counts["rerecord"] == 0 and rec.eager_reasons["live_alias"] > 0
    detail = _counts(rec)
    rec.release()
    return (False, f"DIFFERS from eager; {detail}") if not same(eager, replay) else (ok, detail)


def _shared_pool(device: str, backend: str, others: bool) -> tuple[bool, str]:
    _determinism(device)
    eager, _ = zero_in_place_loop("view", device, None)
    pool = rk.MemoryPool()
    other = rk.capture(torch.nn.Linear(8, 4).to(device), backend=backend, pool=pool)
    if not others:
        other.release()  # released: it leaves the pool
    replay, (rec,) = zero_in_place_loop("view", device, backend, pool=pool)
    if others:
        ok = rec.counts["rerecord"] == 0 and rec.eager_reasons["live_alias"] == STEPS - 1
    else:
        ok = _given_then_replayed(rec, STEPS - 2)
    detail = _counts(rec)
    rec.release()
    other.release()
    return (False, f"DIFFERS from eager; {detail}") if not same(eager, replay) else (ok, detail)


def _pattern_case(name: str, unsafe: bool, backend: str, timeout: float) -> tuple[bool, str]:
    [pattern] = [p for p in by_hazard("kept_grads") if p.name == name]
    outcome = run_pattern(pattern, backend, unsafe=unsafe, timeout=timeout)
    j = outcome.journal or {}
    detail = f"{outcome.line()} | rec {j.get('record')} rep {j.get('replay')} rerecord {j.get('rerecord')}"
    if unsafe:
        return outcome.diverged, detail
    if outcome.failed:
        return False, detail
    if pattern.api == "capture":
        ok = outcome.kind.startswith("replayed") and j.get("rerecord") == 1
        return ok and not j.get("eager_reasons"), detail
    return True, detail  # the whole step: exact, replayed or routed with its reason


def _cases(device: str, backend: str, timeout: float) -> list[tuple[str, Callable, float]]:
    cases: list[tuple[str, Callable, float]] = []
    for pattern in by_hazard("kept_grads"):
        for unsafe in (False, True):
            fn = partial(_pattern_case, pattern.name, unsafe, backend, timeout)
            cases.append((f"{pattern.name}{' (unsafe)' if unsafe else ''}", fn, timeout + 30))
    for keep in ("ref", "view", "data"):
        for label, options in (
            ("capture sgd", {}),
            ("capture+OptimizerStep", {"opt_step": {}}),
        ):
            cases.append(
                (
                    f"{label} keep {keep}",
                    partial(_capture_case, keep, device, backend, **options),
                    timeout,
                )
            )
    amp = {"optimizer": "adamw", "amp": True}
    cases.append(
        (
            "capture adamw+amp keep view",
            partial(_capture_case, "view", device, backend, **amp),
            timeout,
        )
    )
    cases.append(
        ("two shapes: every recording dropped", partial(_two_shapes, device, backend), timeout)
    )
    cases.append(
        ("set_to_none=True kept: live_alias", partial(_set_to_none, device, backend), timeout)
    )
    for others in (True, False):
        label = f"MemoryPool {'shared: live_alias' if others else 'sole user: given away'}"
        cases.append((label, partial(_shared_pool, device, backend, others), timeout))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    args = parser.parse_args(argv)
    native = copy_out.holders_move()
    copy_out._swap = None  # as on 2.11 (there: already None)
    warnings.simplefilter("ignore")
    backend = "cuda" if args.device == "cuda" else "emulated"
    print(
        f"torch {torch.__version__}  backend {backend}  native storage swap: {native} (run without it)"
    )
    results = [
        checked_row(label, fn, t, 40) for label, fn, t in _cases(args.device, backend, args.timeout)
    ]
    print(f"{sum(results)}/{len(results)} PASS")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
