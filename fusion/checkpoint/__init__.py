"""Checkpoints shared by workers and the coordinator (DESIGN.md, Checkpoints and failures).

- :mod:`~fusion.checkpoint.state`: a stage's training state as name-keyed tensors;
  merging stage states into a whole-model state and splitting it along another plan.
- :mod:`~fusion.checkpoint.snapshot`: checksummed safetensors snapshots, their stream
  assembler and the host-memory store a worker keeps.
- :mod:`~fusion.checkpoint.durable`: the coordinator's on-disk checkpoints.
"""

from fusion.checkpoint.durable import CheckpointDir, CheckpointFile
from fusion.checkpoint.snapshot import (
    Assembler,
    Snapshot,
    SnapshotStore,
    make_snapshot,
    stage_key,
)
from fusion.checkpoint.state import (
    TensorState,
    capture_volatile,
    capture_weights,
    merge_states,
    model_state,
    parameters_of,
    restore_state,
    stage_subset,
)

__all__ = [
    "Assembler",
    "CheckpointDir",
    "CheckpointFile",
    "Snapshot",
    "SnapshotStore",
    "TensorState",
    "capture_volatile",
    "capture_weights",
    "make_snapshot",
    "merge_states",
    "model_state",
    "parameters_of",
    "restore_state",
    "stage_subset",
    "stage_key",
]
