"""Kept at this path because notebooks/parity.ipynb imports it: the code is :mod:`replaykit.testing.parity.matrix`
(this name is that module)."""

import sys

from .parity import matrix

sys.modules[__name__] = matrix
