"""Baseline planners that OP-Fence is compared against.

They share OP-Fence's output type so that one executor runs them all. This module
works on :class:`fusion.graph.ir.OpDag` data only (no torch).
"""

from __future__ import annotations

import logging

from fusion.errors import PlanError
from fusion.graph.ir import OpDag

logger = logging.getLogger(__name__)


def uniform_assignment(dag: OpDag, num_stages: int) -> dict[str, int]:
    """Split the compute nodes into ``num_stages`` contiguous runs of (nearly) equal node counts.

    The naive decentralized pipeline: nodes in topological order, cut every
    ``len(nodes) / num_stages`` nodes, stage ``i`` on the ``i``-th worker to join.
    """
    nodes = dag.compute_nodes()
    if num_stages < 1:
        raise PlanError(f"need at least one stage, got {num_stages}")
    if num_stages > len(nodes):
        raise PlanError(f"cannot split {len(nodes)} compute nodes into {num_stages} non-empty stages")
    return {n.name: i * num_stages // len(nodes) for i, n in enumerate(nodes)}
