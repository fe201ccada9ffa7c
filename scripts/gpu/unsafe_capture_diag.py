"""Where an unsafe arm's CUDA capture first fails: every exception raised while a stream captures,
caught ones included, with the Python frame that saw it. ``PYTHONPATH=. python
scripts/gpu/unsafe_capture_diag.py [PATTERN ...]`` (default: step_autocast_region_per_step)."""

from __future__ import annotations

import sys

import torch

from replaykit.testing.hazards import pattern, run_pattern

seen: list[str] = []


def tracer(frame, event, arg):
    if event == "exception" and torch.cuda.is_current_stream_capturing():
        exc = arg[1]
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]} @ {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
        if not seen or seen[-1] != line:
            seen.append(line)
    return tracer


for name in sys.argv[1:] or ["step_autocast_region_per_step"]:
    for unsafe in (False, True):
        seen.clear()
        sys.settrace(tracer)
        try:
            out = run_pattern(pattern(name), "cuda", unsafe=unsafe)
        finally:
            sys.settrace(None)
        print(f"{name} unsafe={unsafe}: {out.line()[:300]}")
        for s in seen[:25]:
            print("   ", s)
