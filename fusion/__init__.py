"""fusion: decentralized training over slow, uneven links.

The public Python API. ``fusion.export`` captures a model as an :class:`OpDag`; the
executor, scheduler and compression packages build on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusion.errors import (
    AuthError,
    CompressionError,
    ConfigError,
    FusionError,
    GraphExportError,
    NotFoundError,
    PlanError,
    RemoteError,
    SplitError,
    StageError,
    StateError,
    WireError,
)
from fusion.graph.ir import OpDag, OpEdge, OpNode

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import torch

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "CompressionError",
    "ConfigError",
    "FusionError",
    "GraphExportError",
    "NotFoundError",
    "OpDag",
    "OpEdge",
    "OpNode",
    "PlanError",
    "RemoteError",
    "SplitError",
    "StageError",
    "StateError",
    "WireError",
    "export",
]


def export(model: torch.nn.Module, example_inputs: Sequence[Any], *, leaf_modules: Iterable[str] = ()) -> OpDag:
    """Capture ``model`` as a costed operator DAG (torch.fx first, torch.export as fallback).

    Args:
        model: the module to capture (in the mode it will train in).
        example_inputs: positional inputs of one micro-batch; used for shape propagation,
            FLOP counting and (for the fallback) specialisation.
        leaf_modules: dotted module paths to keep whole as single nodes.

    Raises:
        GraphExportError: the model cannot be captured; the message names the failing module.
    """
    from fusion.graph.export import export as _export

    return _export(model, example_inputs, leaf_modules=leaf_modules)
