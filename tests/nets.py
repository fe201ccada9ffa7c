"""Networks only the tests need."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    """A shared trunk, two heads, and a branch the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.a(h), self.b(h)


class WithKwargs(nn.Module):
    """Keyword tensors, a non-tensor argument, and nested outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(
        self, x: torch.Tensor, *, bias: torch.Tensor, scale: float = 1.0, options: object = None
    ) -> dict:
        y = self.lin(x) * scale + bias
        return {"y": y, "pair": (y.sum(1), torch.sigmoid(y))}
