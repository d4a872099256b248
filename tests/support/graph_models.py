"""Tiny models that exercise the corners of graph capture (used by the unit tests only)."""

from __future__ import annotations

import torch
import torch.nn as nn


class SignGate(nn.Module):
    """Branches on a tensor *value*: neither ``symbolic_trace`` nor ``torch.export`` can capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return -x


class GatedNet(nn.Module):
    """A chain whose middle child (``gate``) has data-dependent control flow."""

    def __init__(self, features: int = 4, num_classes: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.gate = SignGate()
        self.head = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.fc(x)))  # (B, num_classes)


class TupleOutputNet(nn.Module):
    """Returns two tensors, which the OP-DAG refuses (the loss needs one output)."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y + 1
