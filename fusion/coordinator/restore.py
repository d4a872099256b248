"""Restoring a job's stages to one step: from snapshots, a durable checkpoint, or the start.

After a worker is lost (or leaves, or a re-plan adds one), every stage of the job's new
placement must hold the state of one and the same step ``R`` before training resumes at
``R``. Where that state can come from, best first:

1. **Snapshots** held in workers' memory (each worker's own, and the replicas it holds for
   its peers). A new stage whose node set equals an old stage's (same stage key) is restored
   straight from a snapshot of it: locally if its new worker holds one, else pulled by the
   new worker from the holder. A stage cut differently (after a re-plan) is given its slice of
   the whole-model state, merged by the coordinator from all old stages' snapshots.
2. A **durable checkpoint** on the coordinator's disk (when a stage and its buddy died at
   once, or the coordinator restarted).
3. The **initial model** (step 0): always available, since the coordinator builds it
   deterministically from the job's seed.

``R`` is the newest step for which one of these covers every stage; the data of steps
``R``, ``R+1``, … is then replayed, so the result equals an uninterrupted run. When to
restore, and what to do first, is :class:`fusion.coordinator.recovery.Recovery`'s.

A snapshot read never depends on one holder: a holder that fails it (lost, leaving, or
refusing the caller's credential after a re-placement) is reported through ``warn`` and
struck from the holdings, and the next holder (a replica) is tried. When no holder of a
needed snapshot is left, :class:`~fusion.errors.CheckpointError` says so; the caller then
chooses the restore point again from the pruned holdings (an older step, a durable
checkpoint: steps are redone, none is lost).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from executor.client import ChannelPool, ExecutorClient, run_parallel
from executor.driver import PipelineDriver
from fusion.checkpoint import (
    CheckpointDir,
    CheckpointFile,
    make_snapshot,
    merge_states,
    model_state,
    stage_subset,
)
from fusion.errors import CheckpointError, FusionError

logger = logging.getLogger(__name__)

#: (stage key, step) -> addresses of the workers holding that snapshot.
Holdings = dict[tuple[str, int], list[str]]
#: ``warn(address, reason)``: a holder failed a snapshot read and is skipped.
Warn = Callable[[str, str], None]
T = TypeVar("T")

_HOLDINGS_LOCK = threading.Lock()


def from_holders(held: Holdings, key: str, step: int, read: Callable[[str], T], warn: Warn) -> T:
    """``read(address)`` from the first holder of snapshot ``(key, step)`` that serves it.

    Each holder that fails is reported (``warn``) and removed from ``held`` (so a restore
    point chosen afterwards does not count on it); the next one is tried.

    Raises:
        CheckpointError: no holder of the snapshot served it.
    """
    failures: list[str] = []
    while True:
        with _HOLDINGS_LOCK:
            holders = list(held.get((key, step), []))
        if not holders:
            tried = f" ({'; '.join(failures)})" if failures else ""
            raise CheckpointError(f"no worker could serve the snapshot of stage {key} at step {step}{tried}")
        address = holders[0]
        try:
            return read(address)
        except FusionError as e:
            reason = str(e)
            failures.append(f"{address}: {reason}")
            with _HOLDINGS_LOCK:
                left = [a for a in held.get((key, step), []) if a != address]
                if left:
                    held[(key, step)] = left
                else:
                    held.pop((key, step), None)
            logger.warning("snapshot of stage %s at step %d unreadable from %s: %s", key, step, address, reason)
            warn(address, reason)


#: Seconds a worker of the job has to list its snapshots.
LIST_TIMEOUT_S = 5.0
#: The same for a worker just declared gone: a frozen or cut-off one would hold the whole
#: recovery for the full deadline, and its stages' replicas sit on other workers anyway.
#: One that is only late under load still answers a listing this quickly.
DROPPED_LIST_TIMEOUT_S = 2.0


def snapshot_holdings(
    job_id: str, addresses: Iterable[str], pool: ChannelPool, *, dropped: Iterable[str] = ()
) -> Holdings:
    """Which worker holds which complete snapshot; workers that do not answer hold nothing.
    ``dropped``: workers just declared gone, asked too but with a shorter deadline."""
    dropped = set(dropped)
    addresses = list(dict.fromkeys([*addresses, *dropped]))

    def ask(address: str) -> list[tuple[str, int]]:
        timeout_s = DROPPED_LIST_TIMEOUT_S if address in dropped else LIST_TIMEOUT_S
        try:
            return [
                (i.stage_key, int(i.step))
                for i in ExecutorClient(address, pool).list_snapshots(job_id, timeout_s=timeout_s)
            ]
        except FusionError as e:
            logger.info("listing snapshots on %s failed: %s", address, e)
            return []

    held: Holdings = {}
    for address, keys in zip(
        addresses, run_parallel([lambda a=a: ask(a) for a in addresses], name="list-snapshots"), strict=False
    ):
        for key in keys:
            held.setdefault(key, []).append(address)
    return held


@dataclass(frozen=True)
class RestorePoint:
    """The step to resume at and where its state comes from."""

    step: int
    source: str
    """``"snapshots"``, ``"durable"`` or ``"initial"``."""
    durable: CheckpointFile | None = None

    def describe(self) -> str:
        if self.source == "durable" and self.durable is not None:
            return f"durable checkpoint {self.durable.path.name} (step {self.step})"
        if self.source == "initial":
            return "the initial model (step 0)"
        return f"snapshots in workers' memory (step {self.step})"


def choose_restore_point(
    old_keys: Sequence[str], held: Holdings, durable: Sequence[CheckpointFile], *, at_most: int | None = None
) -> RestorePoint:
    """The newest step every old stage can be restored to (snapshots win ties)."""
    steps = {step for _, step in held}
    complete = [s for s in steps if all(held.get((k, s)) for k in old_keys) and (at_most is None or s <= at_most)]
    best = RestorePoint(step=0, source="initial")
    if complete:
        best = RestorePoint(step=max(complete), source="snapshots")
    for ckpt in durable:
        if ckpt.step > best.step and (at_most is None or ckpt.step <= at_most):
            best = RestorePoint(step=ckpt.step, source="durable", durable=ckpt)
    return best


class WholeState:
    """The whole-model state at a restore point, built only if some stage needs it."""

    def __init__(
        self,
        point: RestorePoint,
        *,
        job_id: str,
        old_keys: Sequence[str],
        held: Holdings,
        pool: ChannelPool,
        checkpoints: CheckpointDir,
        initial: Callable[[], Mapping[str, torch.Tensor]],
        canonical: Callable[[str], str],
        warn: Warn = lambda address, reason: None,
    ) -> None:
        self.point = point
        self.warn = warn
        self.job_id = job_id
        self.old_keys = list(old_keys)
        self.held = held
        self.pool = pool
        self.checkpoints = checkpoints
        self.initial = initial
        self.canonical = canonical
        self._whole: dict[str, torch.Tensor] | None = None

    def get(self) -> dict[str, torch.Tensor]:
        if self._whole is None:
            self._whole = self._build()
        return self._whole

    def _build(self) -> dict[str, torch.Tensor]:
        p = self.point
        if p.source == "initial":
            return model_state(self.initial())
        if p.source == "durable":
            assert p.durable is not None
            return self.checkpoints.load(p.durable)

        def fetch(key: str) -> dict[str, torch.Tensor]:
            return from_holders(
                self.held,
                key,
                p.step,
                lambda a: ExecutorClient(a, self.pool).get_snapshot(self.job_id, key, p.step).tensors(),
                self.warn,
            )

        fetched = run_parallel([lambda k=k: fetch(k) for k in self.old_keys], name="fetch-snapshot")
        return merge_states(fetched, self.canonical)


@dataclass(frozen=True)
class Restored:
    """What :func:`restore_stages` did: per stage, where its state came from (for the job's
    events), and the loss of the step before the restore point where the loss stage's
    snapshot carried it (:attr:`fusion.checkpoint.snapshot.Snapshot.step_loss`)."""

    sources: dict[int, str]
    step_loss: float | None = None


def restore_stages(
    driver: PipelineDriver,
    point: RestorePoint,
    held: Holdings,
    whole: WholeState,
    warn: Warn = lambda address, reason: None,
) -> Restored:
    """Bring every stage of ``driver`` (loaded, parameters not yet set) to ``point.step``.

    A stage restored straight from a snapshot reads it from its own worker when that holds
    one, else from the other holders in turn (:func:`from_holders`).

    Raises:
        CheckpointError: no holder served a snapshot the restore needs (``held`` no longer
            lists the holders that failed), or the durable checkpoint failed its checks.
    """
    job_id = driver.job_id
    step = point.step
    sources: dict[int, str] = {}
    losses: dict[int, float] = {}
    direct: list[int] = []
    for spec in driver.stages:
        holders = held.get((driver.stage_keys[spec.stage_idx], step), []) if point.source == "snapshots" else []
        if holders:
            direct.append(spec.stage_idx)
    needs_whole = [s.stage_idx for s in driver.stages if s.stage_idx not in direct]
    if needs_whole:
        whole.get()  # build once, before the parallel pushes

    def one(idx: int) -> None:
        client = driver.clients[idx]
        address = driver.addresses[idx]
        key = driver.stage_keys[idx]
        if idx in direct:
            with _HOLDINGS_LOCK:  # its own copy first: nothing crosses the network
                holders = held.get((key, step), [])
                if address in holders:
                    held[(key, step)] = [address, *[a for a in holders if a != address]]

            def pull(source: str) -> str:
                info = client.restore_stage(job_id, idx, step, source_address="" if source == address else source)
                if info.HasField("step_loss"):
                    losses[idx] = info.step_loss
                return source

            source = from_holders(held, key, step, pull, warn)
            # Held locally: its own snapshot, or the replica it kept as the lost worker's buddy.
            sources[idx] = "the snapshot on its worker" if source == address else f"the replica on {source}"
            return
        state = stage_subset(whole.get(), driver.state_names(idx), driver.canonical)
        client.put_snapshot(make_snapshot(job_id, idx, key, step, state))
        client.restore_stage(job_id, idx, step)
        sources[idx] = point.describe()

    run_parallel([lambda i=i: one(i) for i in range(len(driver.stages))], name="restore")
    return Restored(sources, losses.get(driver.loss_stage))
