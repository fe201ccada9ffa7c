import os
import sys
import traceback

sys.path.insert(0, os.getcwd())
import torch

from replaykit.testing.hazards import crashes, runner

print("torch", torch.__version__, flush=True)
for p in crashes.PATTERNS:
    if "selective_activation" not in p.name:
        continue
    for backend in ("emulated", "cuda") if torch.cuda.is_available() else ("emulated",):
        for arm in ("eager", "replay"):
            r = runner._run_arm(p, runner._device_of(backend), backend, (), arm)
            print(
                f"== {p.name} {backend} {arm}: error={type(r.error).__name__ if r.error else None} journal={r.journal}",
                flush=True,
            )
            if r.error:
                traceback.print_exception(r.error)
