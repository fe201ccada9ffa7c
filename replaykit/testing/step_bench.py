"""Kept at this path because notebooks/benchmark.ipynb imports it: the code is :mod:`replaykit.testing.bench.step`
(this name is that module)."""

import sys

from .bench import step

sys.modules[__name__] = step
