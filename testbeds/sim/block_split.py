"""The even split of the pipelining baseline, shared by the real run and the simulator.

A model's *blocks* are the children of its ``ModuleList``/``Sequential`` containers that
are indexed by position (GPT-2's ``transformer.h.0 … h.{n-1}``, ResNet's ``layer1.0 …
layer4.{k}``), outermost only. The even split gives each of ``S`` stages the same number of
blocks (the first stage also gets what comes before the first block, the last what comes
after the last): the naive split a user of ``torch.distributed.pipelining`` writes by hand,
with no profiling and no view of the links.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def block_names(model: torch.nn.Module) -> list[str]:
    """Fully qualified names of the model's repeated blocks, in registration order."""
    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    blocks: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, containers):
            continue
        if any(name.startswith(b + ".") for b in blocks):
            continue  # inside a block already listed: keep the outermost only
        for child, _ in module.named_children():
            if child.isdigit():
                blocks.append(f"{name}.{child}" if name else child)
    return blocks


def even_split_points(blocks: Sequence[str], num_stages: int) -> list[str]:
    """The blocks that begin stages ``1 .. S-1`` when ``S`` stages get equal block counts.

    Raises:
        ValueError: fewer blocks than stages, or ``num_stages < 1``.
    """
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if len(blocks) < num_stages:
        raise ValueError(f"{len(blocks)} blocks cannot make {num_stages} stages")
    return [blocks[s * len(blocks) // num_stages] for s in range(1, num_stages)]


def split_stages(blocks: Sequence[str], module_paths: Sequence[str], num_stages: int) -> list[int]:
    """The stage of each unit (its module path, in execution order) under
    :func:`even_split_points`: a stage begins at the first unit of its split point's block."""
    points = even_split_points(blocks, num_stages)
    stages, current = [], 0
    for path in module_paths:
        while current < len(points) and (path == points[current] or path.startswith(points[current] + ".")):
            current += 1
        stages.append(current)
    return stages


def num_pipeline_stages(model: torch.nn.Module, num_hosts: int) -> int:
    """As many stages as hosts, but no more than the model has blocks."""
    return max(1, min(num_hosts, len(block_names(model))))
