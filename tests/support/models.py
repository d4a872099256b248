"""Models that exist only for tests, built by workers as ``tests.support.models:<factory>``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ControlFlowNet(nn.Module):
    """A classifier whose forward branches on tensor shapes, so ``symbolic_trace`` fails.

    Models from popular libraries do this (``if x.dim() == 4``, ``if x.size(-1) > n``);
    capture must fall back to ``torch.export``.
    """

    def __init__(self, in_features: int = 3 * 8 * 8, hidden: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # (B, C, H, W) -> (B, C*H*W)
            x = x.flatten(1)
        h = F.gelu(self.fc1(x))
        if h.size(-1) > 16:
            h = h + F.gelu(self.fc2(h))
        else:
            h = self.fc2(h)
        h = h + torch.tanh(self.fc3(h))
        return self.head(h)


def control_flow_net(**kwargs: int) -> ControlFlowNet:
    """Factory for jobs: ``model.name = "tests.support.models:control_flow_net"``."""
    return ControlFlowNet(**kwargs)
