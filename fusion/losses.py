"""Training losses by name.

A loss takes the model's output and the batch targets and returns a scalar. Keeping it out
of the model keeps the traced graph's output the logits, which the last pipeline stage
passes to the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.nn import functional as F

from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["LossFn", "cross_entropy", "get_loss", "loss_names"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(output, target) -> scalar tensor``."""


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every sample.

    Args:
        output: logits with classes last, (B, C) for classification or (B, T, C) for a
            language model.
        target: class indices with the leading shape of ``output``, (B,) or (B, T).

    Returns:
        A scalar tensor.
    """
    logits = output.reshape(-1, output.size(-1))  # (N, C)
    return F.cross_entropy(logits, target.reshape(-1))  # ()


_LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy}


def loss_names() -> list[str]:
    """Names accepted by :func:`get_loss`."""
    return sorted(_LOSSES)


def get_loss(name: str) -> LossFn:
    """The loss function registered under ``name``.

    Raises:
        ConfigError: no loss has that name.
    """
    try:
        return _LOSSES[name]
    except KeyError:
        raise ConfigError(f"unknown loss {name!r}; choose one of {loss_names()}") from None
