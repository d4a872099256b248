"""Snapshots: one stage's state after a given step, as a checksummed safetensors blob.

A snapshot travels as bytes (to a buddy worker, to the coordinator) and is only ever turned
back into tensors after its SHA-256 matched, by ``safetensors`` (which reads a JSON header
and raw tensor bytes; nothing is unpickled). :class:`Assembler` rebuilds one from a chunked
stream and refuses it unless every declared byte arrived and the checksum matches, so a
replica cut mid-stream is never stored, let alone loaded. :class:`SnapshotStore` is the
host-memory store a worker keeps (its own snapshots and the replicas it holds for peers).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from fusion.errors import CheckpointError, NotFoundError

#: Largest snapshot a worker accepts from the network.
MAX_SNAPSHOT_BYTES = 64 << 30


def stage_key(nodes: list[str] | tuple[str, ...], graph_fingerprint: str = "") -> str:
    """Names a stage by its node set, so snapshots never cross into a different stage."""
    h = hashlib.sha256(graph_fingerprint.encode())
    for n in sorted(nodes):
        h.update(b"\0" + n.encode())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class Snapshot:
    """A stage's state after ``step`` optimizer steps."""

    job_id: str
    stage_idx: int
    stage_key: str
    step: int
    data: bytes | bytearray
    sha256: str
    replica: bool = False

    @property
    def size_bytes(self) -> int:
        return len(self.data)

    @functools.cached_property
    def step_loss(self) -> float | None:
        """The loss of step ``step - 1`` where the snapshot carries it (the loss stage's, see
        :func:`snapshot_metadata`); ``None`` where it does not, or its header is unreadable.
        Read from the header once."""
        try:
            value = float(read_metadata(self.data)[STEP_LOSS_KEY])
        except (CheckpointError, KeyError, ValueError):
            return None
        return value if math.isfinite(value) else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state, after checking the checksum (raises :class:`CheckpointError`)."""
        return decode(self.data, self.sha256, what=f"snapshot of stage {self.stage_idx} at step {self.step}")


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, str]:
    """Serialise a state: safetensors bytes and their hex SHA-256."""
    data = serialize(tensors, metadata)
    return data, hashlib.sha256(data).hexdigest()


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Safetensors bytes of a state (the one copy a snapshot makes of live weights)."""
    from safetensors.torch import save

    seen: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        # safetensors refuses tensors that share memory (tied weights): store a copy.
        flat[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return save(flat, metadata=dict(metadata or {}))


def decode(data: bytes | bytearray, sha256: str, *, what: str = "snapshot") -> dict[str, torch.Tensor]:
    """Tensors from snapshot bytes; refuses bytes whose checksum does not match."""
    from safetensors.torch import load

    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise CheckpointError(f"{what} is corrupt: SHA-256 {actual[:16]}… does not match the recorded {sha256[:16]}…")
    try:
        return load(bytes(data))
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"{what} is not a valid safetensors blob: {e}") from None


#: Snapshot metadata key of the loss of the step that produced the state (loss stage only).
STEP_LOSS_KEY = "step_loss"
#: Largest safetensors header :func:`read_metadata` parses.
MAX_HEADER_BYTES = 100 << 20


def snapshot_metadata(
    job_id: str, stage_idx: int, key: str, step: int, *, step_loss: float | None = None
) -> dict[str, str]:
    """The metadata a snapshot carries in its safetensors header. ``step_loss``: on the loss
    stage, the loss of step ``step - 1``, whose update the state holds. A worker lost after
    every stage finished that step, before the driver heard its end, leaves that loss in
    this snapshot and its replica only (:meth:`fusion.coordinator.recovery.Recovery.recover`)."""
    meta = {"job_id": job_id, "stage_idx": str(stage_idx), "stage_key": key, "step": str(step)}
    if step_loss is not None:
        meta[STEP_LOSS_KEY] = repr(float(step_loss))
    return meta


def read_metadata(data: bytes | bytearray) -> dict[str, str]:
    """The metadata of a safetensors blob, read from its header (an 8-byte little-endian
    length, then that many bytes of JSON) without loading a tensor; ``CheckpointError`` for
    a header that is not one. Parsed as JSON: data, never code."""
    if len(data) < 8:
        raise CheckpointError(f"snapshot of {len(data)} bytes has no safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > min(len(data) - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"snapshot header declares {size} bytes; the blob holds {len(data) - 8} after it")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past the parser's depth
        raise CheckpointError(f"snapshot header is not JSON: {type(e).__name__}: {e}") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("snapshot header's metadata is not a map of strings")
    return meta


def make_snapshot(
    job_id: str,
    stage_idx: int,
    key: str,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    step_loss: float | None = None,
) -> Snapshot:
    data, sha = encode(tensors, snapshot_metadata(job_id, stage_idx, key, step, step_loss=step_loss))
    return Snapshot(job_id=job_id, stage_idx=stage_idx, stage_key=key, step=step, data=data, sha256=sha)


def snapshot_of(job_id: str, stage_idx: int, key: str, step: int, data: bytes) -> Snapshot:
    """A snapshot of already serialised state (hashes it)."""
    return Snapshot(
        job_id=job_id, stage_idx=stage_idx, stage_key=key, step=step, data=data, sha256=hashlib.sha256(data).hexdigest()
    )


class Assembler:
    """Rebuilds a snapshot from chunks; ``finish`` refuses anything short, long or corrupt."""

    def __init__(
        self,
        job_id: str,
        stage_idx: int,
        key: str,
        step: int,
        size_bytes: int,
        sha256: str,
        *,
        replica: bool,
        max_bytes: int = MAX_SNAPSHOT_BYTES,
    ) -> None:
        if not job_id or not key:
            raise CheckpointError("a snapshot stream must name its job and stage key in the first chunk")
        if size_bytes > max_bytes:
            raise CheckpointError(f"snapshot of {size_bytes} bytes exceeds the {max_bytes}-byte limit")
        if len(sha256) != 64:
            raise CheckpointError("a snapshot stream must carry the blob's hex SHA-256")
        self.meta = (job_id, stage_idx, key, step, sha256, replica)
        self.size_bytes = size_bytes
        self._buf = bytearray()

    def add(self, data: bytes) -> None:
        if len(self._buf) + len(data) > self.size_bytes:
            raise CheckpointError(f"snapshot stream carries more than its declared {self.size_bytes} bytes")
        self._buf += data

    def finish(self) -> Snapshot:
        job_id, stage_idx, key, step, sha256, replica = self.meta
        if len(self._buf) != self.size_bytes:
            raise CheckpointError(
                f"snapshot of stage {stage_idx} at step {step} is incomplete: "
                f"{len(self._buf)} of {self.size_bytes} bytes arrived"
            )
        data, self._buf = self._buf, bytearray()  # no second copy of a blob that may be gigabytes
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise CheckpointError(
                f"snapshot of stage {stage_idx} at step {step} is corrupt: its SHA-256 does not match"
            )
        return Snapshot(
            job_id=job_id, stage_idx=stage_idx, stage_key=key, step=step, data=data, sha256=sha256, replica=replica
        )


def chunks_of(data: bytes | bytearray, chunk_bytes: int) -> Iterator[memoryview]:
    view = memoryview(data)
    for i in range(0, max(len(data), 1), chunk_bytes):
        yield view[i : i + chunk_bytes]


class SnapshotStore:
    """A worker's snapshots in host memory: the newest ``keep`` of its own per (job, stage
    key), and the newest ``keep_replicas`` it holds for a peer.

    One replica is enough: a replica is stored only once complete, so the newest one held is
    the newest the peer finished sending, and the owners keep two of their own in case the
    failure came while the newest replica was still on its way.
    """

    def __init__(self, keep: int = 2, keep_replicas: int = 1) -> None:
        self.keep = keep
        self.keep_replicas = keep_replicas
        # (job, stage key, replica?) -> step -> snapshot
        self._items: dict[tuple[str, str, bool], dict[int, Snapshot]] = {}
        self._lock = threading.Lock()

    def put(self, snap: Snapshot) -> None:
        """Store ``snap``; older ones of its kind beyond the limit go (never ``snap`` itself:
        a restore source pushed for an older step must survive until it is used)."""
        with self._lock:
            by_step = self._items.setdefault((snap.job_id, snap.stage_key, snap.replica), {})
            by_step[snap.step] = snap
            keep = self.keep_replicas if snap.replica else self.keep
            newest = sorted(by_step)[-keep:]
            for old in [s for s in by_step if s not in newest and s != snap.step]:
                del by_step[old]

    def get(self, job_id: str, key: str, step: int) -> Snapshot:
        with self._lock:
            for replica in (False, True):
                snap = self._items.get((job_id, key, replica), {}).get(step)
                if snap is not None:
                    return snap
            held = sorted({s for r in (False, True) for s in self._items.get((job_id, key, r), {})})
            raise NotFoundError(
                f"no snapshot of stage {key} of job {job_id!r} at step {step} here (held steps: {held or 'none'})"
            )

    def list(self, job_id: str) -> list[Snapshot]:
        with self._lock:
            return [s for (j, _, _), by_step in self._items.items() if j == job_id for s in by_step.values()]

    def drop_job(self, job_id: str) -> None:
        with self._lock:
            for k in [k for k in self._items if k[0] == job_id]:
                del self._items[k]
