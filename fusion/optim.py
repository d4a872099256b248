"""The job's optimizer, built the same way on every stage and in the single-process reference.

Parity between a split run and plain PyTorch needs every stage to run exactly the optimizer
a single process would run on its parameters. The mapping from ``[train]`` is therefore
fixed (the "Determinism" contract in ``DESIGN.md``):

- ``sgd``: ``torch.optim.SGD(params, lr, momentum=momentum, weight_decay=weight_decay or 0)``;
- ``adamw``: ``torch.optim.AdamW(params, lr, ...)`` with only the given ones of
  ``weight_decay``, ``betas`` and ``eps``, so PyTorch's defaults apply to the rest
  (``weight_decay=0.01``, ``betas=(0.9, 0.999)``, ``eps=1e-8``).

SGD and AdamW update each parameter from its own gradient and state only, so running them
per stage over that stage's parameters equals running them once over the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from fusion.config import TrainSpec
from fusion.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["build_optimizer"]


def build_optimizer(train: TrainSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Builds the job's optimizer over ``params``.

    Args:
        train: the job's ``[train]`` section.
        params: the parameters to optimize (e.g. one stage's). May be empty: a stage with
            no parameters (a pure reshape or loss stage) still gets an optimizer of the
            configured type over one empty parameter group, whose ``step()``,
            ``zero_grad()`` and ``state_dict()`` work and do nothing.

    Returns:
        A ``torch.optim.SGD`` or ``torch.optim.AdamW``.

    Raises:
        ConfigError: ``train.optimizer`` is not a known optimizer.
    """
    param_list = list(params)
    # torch rejects an empty parameter list but accepts one group with no parameters.
    groups: list[torch.nn.Parameter] | list[dict[str, Any]] = param_list if param_list else [{"params": []}]
    if train.optimizer == "sgd":
        return torch.optim.SGD(
            groups,
            lr=train.lr,
            momentum=train.momentum,
            weight_decay=train.weight_decay if train.weight_decay is not None else 0.0,
        )
    if train.optimizer == "adamw":
        given: dict[str, Any] = {}
        if train.weight_decay is not None:
            given["weight_decay"] = train.weight_decay
        if train.betas is not None:
            given["betas"] = train.betas
        if train.eps is not None:
            given["eps"] = train.eps
        return torch.optim.AdamW(groups, lr=train.lr, **given)
    # TrainSpec validates the name; this guards a spec built around that validation.
    raise ConfigError(f"train.optimizer must be one of 'sgd', 'adamw', got {train.optimizer!r}")
