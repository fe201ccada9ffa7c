"""Kept at this path because notebooks/benchmark.ipynb imports it: the code is :mod:`replaykit.testing.bench.lightning_step`
(this name is that module)."""

import sys

from .bench import lightning_step

sys.modules[__name__] = lightning_step
