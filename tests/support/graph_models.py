"""Tiny models that exercise the corners of graph capture, and captured bundled models (tests only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fusion.graph.export import CapturedModel, capture
from fusion.graph.ir import OpDag
from fusion.models import build_model


@dataclass
class Captured:
    """A model, its example input and what :func:`fusion.graph.export.capture` made of it."""

    model: nn.Module
    example: torch.Tensor
    captured: CapturedModel

    @property
    def dag(self) -> OpDag:
        return self.captured.dag

    @property
    def compute(self) -> list[str]:
        """Names of the compute nodes, in topological order."""
        return [n.name for n in self.dag.compute_nodes()]


def captured_gpt2_tiny() -> Captured:
    """GPT-2 tiny in eval mode on a (2, 8) batch of token ids."""
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny").eval()
    idx = torch.randint(0, 256, (2, 8))  # (B, T)
    return Captured(model, idx, capture(model, (idx,)))


def captured_resnet_tiny(*, train: bool = False) -> Captured:
    """ResNet tiny (4 classes) on a (2, 3, 16, 16) batch of images."""
    torch.manual_seed(0)
    model = build_model("resnet", "tiny", num_classes=4).train(train)
    x = torch.randn(2, 3, 16, 16)  # (B, C, H, W)
    return Captured(model, x, capture(model, (x,)))


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
