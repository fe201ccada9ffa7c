"""A user's own settings module, imported by a model's forward (``host_values``): a plain value
read as ``user_settings.SCALE`` and a helper function that reads this module's globals."""

from __future__ import annotations

import torch

#: written by a training loop's schedule between steps
SCALE = 1.0
#: read only by ``sharpen``, a function the forward calls
SHARPNESS = 1.0


def sharpen(t: torch.Tensor) -> torch.Tensor:
    return t * SHARPNESS
