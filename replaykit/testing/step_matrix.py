"""Kept at this path because notebooks/parity.ipynb imports it: the code is :mod:`replaykit.testing.parity.step_matrix`
(this name is that module)."""

import sys

from .parity import step_matrix

sys.modules[__name__] = step_matrix
