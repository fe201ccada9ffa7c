"""replaykit-demo (what `make demo-core` runs): replay vs eager with plain PyTorch on the device
present, as a parity table and a journal. (`make demo` runs the parity notebook instead.)

    replaykit-demo [--device cuda|cpu] [--steps 3]      # or: python -m replaykit.testing.demo

CUDA graphs when a GPU is present, the emulated backend otherwise. Each row trains
the same detection net eagerly and under replay and compares the end states bit for
bit; the ``unsafe:*`` rows switch one protection off and must diverge.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from replaykit.errors import ReplayWarning
from replaykit.verify.determinism import enable_determinism
from replaykit.workflow import tables

from .nets import DetectionNet
from .parity.scenario import VERDICT_COLUMNS
from .parity.trial import Trial, arms


def rows(device: str, steps: int) -> tuple[list[dict], str]:
    """One row per (scenario, arm) and the journal of the first replay arm."""
    scenarios = {
        "acc1": Trial(steps=steps, device=device),
        "acc2": Trial(steps=steps, accumulation=2, device=device),
        "acc3": Trial(steps=steps, accumulation=3, device=device),
        "acc1+two_forwards": Trial(steps=steps, two_forwards=True, device=device),
        "acc1+kept_outputs": Trial(steps=steps, keep_outputs=True, device=device),
        "acc2+read_two_heads": Trial(steps=steps, accumulation=2, read=(0, 2), device=device),
    }
    # Which protections each scenario exercises: an unsafe arm elsewhere may legitimately match.
    exercises = {
        "acc1": (),
        "acc2": ("copy_out",),
        "acc3": ("copy_out",),
        "acc1+two_forwards": ("hold",),
        "acc1+kept_outputs": ("live_outputs",),
        "acc2+read_two_heads": ("none_pattern",),
    }
    table, journal = [], ""
    for name, trial in scenarios.items():
        for arm, diffs, outcome in arms(trial, DetectionNet):
            protection = arm.split(":", 1)[1] if arm.startswith("unsafe:") else None
            if protection is not None and protection not in exercises[name]:
                continue
            expect_equal = protection is None
            rec = outcome.recorder or {}
            table.append(
                {
                    "scenario": name,
                    "arm": arm,
                    "equal": not diffs,
                    "expected": "equal" if expect_equal else "diverge",
                    "ok": (not diffs) == expect_equal,
                    "tensors_differing": len(diffs),
                    "record": rec.get("record", 0),
                    "replay": rec.get("replay", 0),
                    "eager": rec.get("eager", 0),
                    "eager_reasons": rec.get("eager_reasons", {}),
                }
            )
            if not journal and arm == "replay" and name == "acc2":
                journal = outcome.journal
    return table, journal


COLUMNS = (
    *VERDICT_COLUMNS,
    "record",
    "replay",
    "eager",
    "eager_reasons",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="replaykit-demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    enable_determinism()
    warnings.simplefilter("ignore", ReplayWarning)
    backend = "cuda (CUDA graphs)" if args.device.startswith("cuda") else "emulated"
    print(f"replaykit demo on {args.device}, backend {backend}, torch {torch.__version__}\n")
    table, journal = rows(args.device, args.steps)
    print(tables.text(table, COLUMNS))
    print("\nJournal of the acc2 replay arm:")
    print(journal)
    failed = [r for r in table if not r["ok"]]
    print(f"\n{len(table) - len(failed)} ok, {len(failed)} not as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
