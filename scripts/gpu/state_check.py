"""Host state that replays now (issue 35): each new pattern's safe arm and unsafe arm, on one backend.

    PYTHONPATH=. python scripts/gpu/state_check.py [--backend cuda|emulated] [--timeout 180]

Safe arm: PASS when it replays bitwise (``replayed bitwise``, replay count > 0). Unsafe arm (its
guard switched off, with the recording's verification): PASS when it diverges, or SKIP where the
pattern says that backend cannot show it. Each run has its own deadline (a hang is a FAIL). Exit
status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from replaykit.testing.hazards import pattern, run_pattern
from replaykit.testing.hazards.outcome import REPLAYED

#: the patterns whose safe arm must replay (cache fills, a second network, host draws that choose)
NAMES = (
    "rope_table_grown",
    "step_rope_table_grown",
    "step_gan_generator_trainable_disc",
    "step_gan_generator_trainable_disc_loss_detached",
    "step_mutual_learning_trained_peer",
    "step_gan_disc_layer_replaced",
    "layerdrop_python_random",
    "step_layerdrop_python_random",
    "step_random_task_in_loss",
    "stochastic_depth_numpy_coin",
    "step_stochastic_depth_numpy_coin",
    "private_generator",  # the module's own torch.Generator, registered with the graph
    "private_generator_replaced",
    "whole_step_trainable_critic",  # Lightning's whole step: needs lightning installed
)


def _unsafe_skip(pat, backend: str) -> str | None:
    if pat.unsafe_never:
        return pat.unsafe_never
    if backend == "cuda" and pat.cpu_only:
        return pat.cpu_only
    if backend != "cuda" and pat.cuda_only:
        return pat.cuda_only
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda", choices=("cuda", "emulated"))
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per arm")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    failed = 0
    print(f"{'pattern':<38}{'arm':<8}{'verdict':<6}{'replays':>8}  detail")
    for name in NAMES:
        pat = pattern(name)
        safe = run_pattern(pat, a.backend, timeout=a.timeout)
        replays = safe.journal.get("replay", 0)
        ok = safe.kind == REPLAYED and replays > 0
        failed += not ok
        print(f"{name:<38}{'safe':<8}{'PASS' if ok else 'FAIL':<6}{replays:>8}  {safe.line()[:90]}")
        skip = _unsafe_skip(pat, a.backend)
        if skip is not None:
            print(f"{name:<38}{'unsafe':<8}{'SKIP':<6}{'':>8}  {skip[:90]}")
            continue
        unsafe = run_pattern(pat, a.backend, unsafe=True, timeout=a.timeout)
        ok = unsafe.diverged
        failed += not ok
        print(
            f"{name:<38}{'unsafe':<8}{'PASS' if ok else 'FAIL':<6}"
            f"{unsafe.journal.get('replay', 0):>8}  {unsafe.line()[:90]}"
        )
    print(f"{'FAIL' if failed else 'PASS'}: {failed} failing arm(s) on {a.backend}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
