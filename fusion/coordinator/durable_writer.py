"""Durable checkpoints of a running job, written in the background from its stages' snapshots.

The runner asks for one every ``checkpoint.durable_every`` steps; this fetches every stage's
snapshot of that step from its worker (waiting for the background copy to finish), merges
them into the whole model's state and writes it with :class:`fusion.checkpoint.CheckpointDir`,
recording it with the job's :class:`CheckpointRecords` (the coordinator's SQLite store is
one). Training goes on meanwhile, and when a checkpoint cannot be written (a full disk)
the job logs a ``checkpoint_failed`` event naming the checkpoints it keeps and trains on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from executor.client import ChannelPool, ExecutorClient, run_parallel
from executor.driver import PipelineDriver
from fusion.checkpoint import CheckpointDir, merge_states
from fusion.errors import FusionError, RemoteError

logger = logging.getLogger(__name__)


class CheckpointRecords(Protocol):
    """Where a written checkpoint is recorded (:class:`fusion.coordinator.store.Store` is one)."""

    def add_checkpoint(self, job_id: str, *, step: int, path: str, sha256: str, size_bytes: int, keep: int) -> None:
        """Record a checkpoint file of ``job_id``, keeping the newest ``keep``."""
        ...

    def log(self, job_id: str, kind: str, record: dict[str, Any]) -> int:
        """Append a record to the job's log."""
        ...


class DurableWriter:
    """Writes durable checkpoints in the background from the stages' snapshots.

    Training goes on while a checkpoint is fetched and written; if the previous one is still
    being written when the next is due, the next is skipped (the newer one will come).
    """

    def __init__(
        self, *, job_id: str, pool: ChannelPool, checkpoints: CheckpointDir, records: CheckpointRecords, keep: int
    ) -> None:
        """Checkpoints of ``job_id`` go to ``checkpoints`` and are recorded in ``records``,
        which keeps the newest ``keep``; snapshots are fetched over ``pool``."""
        self.job_id = job_id
        self.pool = pool
        self.checkpoints = checkpoints
        self.records = records
        self.keep = keep
        self._thread: threading.Thread | None = None

    def submit(self, step: int, driver: PipelineDriver) -> None:
        """Start writing the checkpoint of ``step`` from ``driver``'s stages, unless one is being written."""
        if self._thread is not None and self._thread.is_alive():
            logger.info(
                "job %s: durable checkpoint at step %d skipped (the previous one is still being written)",
                self.job_id,
                step,
            )
            return
        keys, addresses = list(driver.stage_keys), list(driver.addresses)
        self._thread = threading.Thread(
            target=self._write, args=(step, keys, addresses, driver.canonical), name=f"durable-{step}", daemon=True
        )
        self._thread.start()

    def _write(self, step: int, keys: list[str], addresses: list[str], canonical: Callable[[str], str]) -> None:
        t0 = time.perf_counter()
        try:
            states = run_parallel(
                [
                    lambda k=k, a=a: _fetch_when_ready(ExecutorClient(a, self.pool), self.job_id, k, step).tensors()
                    for k, a in zip(keys, addresses, strict=False)
                ],
                name="durable-fetch",
            )
            ckpt = self.checkpoints.write(step, merge_states(states, canonical), {"job_id": self.job_id})
            self.records.add_checkpoint(
                self.job_id,
                step=step,
                path=str(ckpt.path),
                sha256=ckpt.sha256,
                size_bytes=ckpt.size_bytes,
                keep=self.keep,
            )
            self.records.log(
                self.job_id,
                "event",
                {
                    "event": "checkpoint",
                    "message": f"durable checkpoint at step {step}: {ckpt.path.name}, "
                    f"{ckpt.size_bytes / 1e6:.1f} MB in {time.perf_counter() - t0:.2f}s",
                    "step": step,
                },
            )
        except OSError as e:
            # A full disk (ENOSPC) or an unwritable directory: the job trains on, with the
            # older checkpoints, which the failed write left in place; the next one is tried
            # as usual, and succeeds once there is room again.
            self._failed(step, f"{e.strerror or type(e).__name__} ({e.filename or self.checkpoints.root})")
        except FusionError as e:
            self._failed(step, str(e))

    def _failed(self, step: int, why: str) -> None:
        kept = [c.path.name for c in self.checkpoints.list()]
        message = f"checkpoint at step {step} failed: {why}; " + (
            f"keeping {', '.join(kept)}" if kept else "no earlier checkpoint to keep"
        )
        logger.warning("job %s: %s", self.job_id, message)
        try:
            self.records.log(
                self.job_id, "event", {"event": "checkpoint_failed", "message": message, "step": step, "kept": kept}
            )
        except Exception:  # the job's log is on the same disk: say it here, and train on
            logger.exception("job %s: could not record the failed checkpoint", self.job_id)

    def wait(self) -> None:
        """Block until the checkpoint being written (if any) is done."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Wait a bounded time for the checkpoint being written (the job is ending)."""
        if self._thread is not None:
            self._thread.join(timeout=60)


def _fetch_when_ready(client: ExecutorClient, job_id: str, key: str, step: int, timeout_s: float = 120.0) -> Any:
    """A stage's snapshot, once its background copy has finished."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.get_snapshot(job_id, key, step)
        except RemoteError as e:
            if e.code != "NOT_FOUND" or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
