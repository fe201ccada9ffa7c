"""Outputs that replay (issue #35): transformers models with their default cache and kept outputs.

    python scripts/gpu/outputs_check.py                 # cuda (the H200)
    python scripts/gpu/outputs_check.py --device cpu    # the emulated backend, same rows

One PASS/FAIL line per case, each under its own deadline (a hang is a FAIL, not a stuck run):

- GPT-2, Llama and T5 (tiny configs from ``replaykit.testing.zoo.hf``, default ``use_cache``) on
  padded and unpadded batches, under ``rk.capture`` (every call's ``ModelOutput`` kept, its cache
  object compared field by field with eager's) and ``rk.TrainStep`` (losses and end state): PASS
  needs bitwise equality and at least one replay;
- the hazard catalogue's ``kept_outputs`` patterns: the safe arm must replay bitwise, the unsafe
  arm (``live_outputs`` off) must diverge.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from functools import partial

import torch

import replaykit as rk
from replaykit.testing.hazards import by_hazard, run_pattern
from replaykit.testing.hazards.deadline import checked_row
from replaykit.testing.zoo import hf
from replaykit.verify.bitwise import diff_states


def _batches(family: str, padded: bool, device: str, n: int) -> list[dict[str, torch.Tensor]]:
    make = hf._seq2seq if family == "t5" else hf._language(causal=True)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        batch = make(2, "cpu", g)[0]
        batch = batch if padded else hf.unpadded(batch)
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


def _train(family: str, padded: bool, api: str, device: str, backend: str | None):
    """Four steps from one seed: every call's output (capture) or loss (step), the end state, the entry."""
    from replaykit.verify.determinism import enable_determinism

    if device == "cuda":
        enable_determinism()
    torch.manual_seed(0)
    model = getattr(hf, family)().module.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=device == "cuda")
    entry = None
    outs = []
    if api == "step":
        entry = rk.TrainStep(
            model,
            lambda m, **b: m(**b).loss,
            opt,
            replay=backend is not None,
            backend=backend or "auto",
        )
        for batch in _batches(family, padded, device, 5):
            outs.append(entry(**batch))
    else:
        entry = rk.capture(model, backend=backend) if backend else None
        for batch in _batches(family, padded, device, 5):
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            outs.append(out)  # kept: each must keep its own values
    state = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return outs, state, entry


def _hf_case(family: str, padded: bool, api: str, device: str) -> tuple[bool, str]:
    backend = "cuda" if device == "cuda" else "emulated"
    eager, e_state, _ = _train(family, padded, api, device, None)
    out, r_state, entry = _train(family, padded, api, device, backend)
    diffs = diff_states(e_state, r_state)
    differs = next(
        (
            d
            for a, b in zip(eager, out, strict=True)
            if (d := hf.output_difference(a, b)) is not None
        ),
        None,
    )
    counts = entry.counts
    detail = (
        f"record {counts['record']} replay {counts['replay']} eager {dict(entry.eager_reasons)}"
    )
    if entry.retire_reason:
        detail += f" retired: {entry.retire_reason[:80]}"
    entry.release()
    if diffs or differs:
        return False, f"DIFFERS {differs or diffs[0].name}; {detail}"
    return counts["replay"] > 0, detail


def _pattern_case(name: str, unsafe: bool, backend: str, timeout: float) -> tuple[bool, str]:
    [pattern] = [p for p in by_hazard("kept_outputs") if p.name == name]
    outcome = run_pattern(pattern, backend, unsafe=unsafe, timeout=timeout)
    if unsafe:
        return outcome.diverged, outcome.line()
    return outcome.kind.startswith("replayed") and not outcome.failed, outcome.line()


def _run(label: str, fn: Callable[[], tuple[bool, str]], timeout: float) -> bool:
    return checked_row(label, fn, timeout, 44)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    backend = "cuda" if args.device == "cuda" else "emulated"
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  backend {backend}")
    results = []
    for family in ("gpt2", "llama", "t5"):
        for padded in (True, False):
            for api in ("capture", "step"):
                label = f"hf_{family} {'padded' if padded else 'unpadded'} {api}"
                results.append(
                    _run(label, partial(_hf_case, family, padded, api, args.device), args.timeout)
                )
    for pattern in by_hazard("kept_outputs"):
        for unsafe in (False, True) if pattern.guard else (False,):
            label = f"{pattern.name}{' (unsafe)' if unsafe else ''}"
            results.append(
                _run(
                    label,
                    partial(_pattern_case, pattern.name, unsafe, backend, args.timeout),
                    args.timeout + 30,
                )
            )
    print(f"{sum(results)}/{len(results)} PASS")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
