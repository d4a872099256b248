"""Durable checkpoints of a running job, written in the background from its stages' snapshots.

The runner asks for one every ``checkpoint.durable_every`` steps; this fetches every stage's
snapshot of that step from its worker (waiting for the background copy to finish), merges
them into the whole model's state and writes it with :class:`fusion.checkpoint.CheckpointDir`,
recording it in SQLite. Training goes on meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from executor.client import ExecutorClient, run_parallel
from executor.driver import PipelineDriver
from fusion.checkpoint import merge_states
from fusion.errors import FusionError, RemoteError

if TYPE_CHECKING:
    from fusion.coordinator.runner import JobRunner

logger = logging.getLogger(__name__)


class DurableWriter:
    """Writes durable checkpoints in the background from the stages' snapshots.

    Training goes on while a checkpoint is fetched and written; if the previous one is still
    being written when the next is due, the next is skipped (the newer one will come).
    """

    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner
        self._thread: threading.Thread | None = None

    def submit(self, step: int, driver: PipelineDriver) -> None:
        if self._thread is not None and self._thread.is_alive():
            logger.info(
                "job %s: durable checkpoint at step %d skipped (the previous one is still being written)",
                self.runner.job_id,
                step,
            )
            return
        keys, addresses = list(driver.stage_keys), list(driver.addresses)
        self._thread = threading.Thread(
            target=self._write, args=(step, keys, addresses, driver.canonical), name=f"durable-{step}", daemon=True
        )
        self._thread.start()

    def _write(self, step: int, keys: list[str], addresses: list[str], canonical: Callable[[str], str]) -> None:
        r = self.runner
        t0 = time.perf_counter()
        try:
            states = run_parallel(
                [
                    lambda k=k, a=a: _fetch_when_ready(ExecutorClient(a, r.pool), r.job_id, k, step).tensors()
                    for k, a in zip(keys, addresses, strict=False)
                ],
                name="durable-fetch",
            )
            ckpt = r.checkpoints.write(step, merge_states(states, canonical), {"job_id": r.job_id})
            r.store.add_checkpoint(
                r.job_id,
                step=step,
                path=str(ckpt.path),
                sha256=ckpt.sha256,
                size_bytes=ckpt.size_bytes,
                keep=r.spec.checkpoint.keep,
            )
            r.store.log(
                r.job_id,
                "event",
                {
                    "event": "checkpoint",
                    "message": f"durable checkpoint at step {step}: {ckpt.path.name}, {ckpt.size_bytes / 1e6:.1f} MB in {time.perf_counter() - t0:.2f}s",
                    "step": step,
                },
            )
        except (FusionError, OSError) as e:
            logger.warning("job %s: durable checkpoint at step %d failed: %s", r.job_id, step, e)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
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
