"""Kept at this path because ``notebooks/hazards.ipynb`` imports it: the catalogue is
:mod:`replaykit.testing.hazards.catalogue` (this name is that module)."""

import sys

from .hazards import catalogue

sys.modules[__name__] = catalogue
