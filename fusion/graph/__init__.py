"""The OP-DAG: capture (:mod:`.export`), the data model (:mod:`.ir`) and stage cuts (:mod:`.split`)."""

from __future__ import annotations

from fusion.graph.ir import OpDag, OpEdge, OpNode, ValueMeta
from fusion.graph.split import DRIVER, StageSpec, split_stages

__all__ = ["DRIVER", "OpDag", "OpEdge", "OpNode", "StageSpec", "ValueMeta", "split_stages"]
