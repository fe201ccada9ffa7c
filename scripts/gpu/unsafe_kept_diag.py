"""The kept-output unsafe arms on CUDA, one process, full tracebacks: where "invalid argument" starts.

PYTHONPATH=. python scripts/gpu/unsafe_kept_diag.py
"""

from __future__ import annotations

import traceback

import torch

import replaykit as rk
from replaykit.testing.hazards import PATTERNS
from replaykit.testing.hazards.pattern import Arm

NAMES = [
    "epoch_metric_keeps_logits",
    "epoch_metric_keeps_a_view",
    "keeps_the_models_losses",
    "returns_a_cache_object",
    "whole_step_input_branch",
]


def main() -> None:
    by = {p.name: p for p in PATTERNS}
    for name in NAMES:
        pat = by[name]
        for disable in ((), (pat.guard,)):
            torch.manual_seed(0)
            model = pat.make("cuda")
            arm = Arm("cuda", "replay", backend="cuda", unsafe_disable=disable)
            try:
                if pat.api == "capture":
                    arm.recorder = rk.capture(model, backend="cuda", unsafe_disable=disable)
                torch.manual_seed(1)
                pat.train(model, arm)
                torch.cuda.synchronize()
                print(
                    f"{name} {disable}: ok {arm.recorder.counts if arm.recorder else ''}",
                    flush=True,
                )
            except Exception:
                print(f"{name} {disable}: RAISED", flush=True)
                traceback.print_exc()
            finally:
                if arm.recorder is not None:
                    try:
                        arm.recorder.release()
                    except Exception:
                        traceback.print_exc()


if __name__ == "__main__":
    main()
