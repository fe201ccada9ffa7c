"""Kept at this path because notebooks/parity.ipynb imports it: the code is :mod:`replaykit.testing.parity.scenario`
(this name is that module)."""

import sys

from .parity import scenario

sys.modules[__name__] = scenario
