"""Moving snapshots between workers: chunked streams, and the rate-limited replicator.

A snapshot crosses the wire as a stream of ``SnapshotChunk`` messages, the first carrying
its ``SnapshotInfo`` (job, stage key, step, size, SHA-256). The receiver rebuilds it with
:class:`fusion.checkpoint.Assembler`, which keeps it only when complete and intact.

The :class:`Replicator` sends each new snapshot of a worker's stages to the stage's buddy,
one at a time and paced below a byte rate, so replication never competes with training
traffic for the link; a newer snapshot of the same stage supersedes one still waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from fusion.checkpoint import Assembler, Snapshot
from fusion.checkpoint.snapshot import MAX_SNAPSHOT_BYTES, chunks_of
from fusion.errors import CheckpointError, FusionError
from fusion.wire import executor_pb2 as epb

logger = logging.getLogger(__name__)


def snapshot_info(snap: Snapshot) -> epb.SnapshotInfo:
    """What a listing or a restore says of ``snap``: its identity, and the step loss its
    metadata carries, if any (:attr:`~fusion.checkpoint.snapshot.Snapshot.step_loss`)."""
    return epb.SnapshotInfo(
        job_id=snap.job_id,
        stage_idx=snap.stage_idx,
        stage_key=snap.stage_key,
        step=snap.step,
        size_bytes=snap.size_bytes,
        sha256=snap.sha256,
        replica=snap.replica,
        step_loss=snap.step_loss,
    )


def snapshot_chunks(snap: Snapshot, chunk_bytes: int, *, rate_bytes_per_s: float = 0.0) -> Iterator[epb.SnapshotChunk]:
    """The stream for ``snap``; with a rate, paced so the average stays below it."""
    t0 = time.perf_counter()
    sent = 0
    for i, piece in enumerate(chunks_of(snap.data, chunk_bytes)):
        if rate_bytes_per_s > 0:
            ahead = sent / rate_bytes_per_s - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        sent += len(piece)
        yield epb.SnapshotChunk(info=snapshot_info(snap) if i == 0 else None, data=bytes(piece))


def assemble(chunks: Iterable[epb.SnapshotChunk], *, replica: bool, max_bytes: int = MAX_SNAPSHOT_BYTES) -> Snapshot:
    """Rebuild a snapshot from its stream (raises :class:`CheckpointError` if anything is off)."""
    assembler: Assembler | None = None
    for chunk in chunks:
        if assembler is None:
            if not chunk.HasField("info"):
                raise CheckpointError("the first chunk of a snapshot stream must carry its info")
            i = chunk.info
            assembler = Assembler(
                i.job_id, i.stage_idx, i.stage_key, i.step, i.size_bytes, i.sha256, replica=replica, max_bytes=max_bytes
            )
        assembler.add(chunk.data)
    if assembler is None:
        raise CheckpointError("empty snapshot stream")
    return assembler.finish()


class Replicator:
    """Sends snapshots to buddies in the background, newest first per stage, paced."""

    def __init__(self, send: Callable[[Snapshot, str, float], None]) -> None:
        self._send = send
        self._pending: dict[tuple[str, str], tuple[Snapshot, str, float]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="replicator", daemon=True)
        self._thread.start()
        self.sent_bytes = 0

    def submit(self, snap: Snapshot, address: str, rate_bytes_per_s: float) -> None:
        with self._cv:
            self._pending[(snap.job_id, snap.stage_key)] = (snap, address, rate_bytes_per_s)
            self._cv.notify()

    def drop_job(self, job_id: str) -> None:
        with self._cv:
            for k in [k for k in self._pending if k[0] == job_id]:
                del self._pending[k]

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key = next(iter(self._pending))
                snap, address, rate = self._pending.pop(key)
            try:
                self._send(snap, address, rate)
                self.sent_bytes += snap.size_bytes
            except FusionError as e:
                logger.warning(
                    "replicating stage %d of job %s (step %d) to %s failed: %s",
                    snap.stage_idx,
                    snap.job_id,
                    snap.step,
                    address,
                    e,
                )

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._pending.clear()
            self._cv.notify()
