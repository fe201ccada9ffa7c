"""The whole step against a raw whole-step CUDA graph at the launch-bound size (issue #32's replay-path
check): ``python scripts/gpu/step_vs_raw.py [--steps 120 --rounds 4]``, arms interleaved in one process."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())

from replaykit.testing.bench import step
from replaykit.testing.bench.timing import SIZES

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=120)
ap.add_argument("--rounds", type=int, default=4)
args = ap.parse_args()
rows = step.table(step.run(SIZES[:1], "cuda", steps=args.steps, rounds=args.rounds))
print(step.markdown(rows))
print(json.dumps(step.summary(rows), default=str))
