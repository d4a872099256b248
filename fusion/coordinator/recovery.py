"""Recovery: bring a job back to one consistent step after its placement changed.

DESIGN.md, Checkpoints and failures: when a worker stops heart-beating the coordinator
pauses the job, re-plans onto the remaining or newly joined workers, restores state from
the replica (or disk), rolls every stage back to the newest common step and replays the
data from there. :class:`Recovery` is that sequence; the runner calls it and goes on
training at the step it returns:

- :meth:`Recovery.recover` after a failed step: find the workers that are gone (or sent
  poisoned tensors), drop them, let spares step in or re-plan onto the rest, restore every
  stage and replay from the restore point. A step that failed because a stage outgrew its
  worker's memory cap is re-planned with the peak measured (:mod:`~fusion.coordinator.memory_ledger`).
  When the workers left cannot hold the model, the job waits, ``pending`` and saying how
  much memory it needs and has, its state safe in the replicas and durable checkpoints,
  until enough memory joins;
- :meth:`Recovery.move` between steps, when workers leave or joiners are put to use: every
  stage snapshots the step first, so nothing is redone;
- :meth:`Recovery.resume` after a coordinator restart, from the newest durable checkpoint.

Where the state comes from is :mod:`fusion.coordinator.restore`'s; what recovery needs
of the job (its workers, a way to place it anew, its log) is :class:`RecoveringJob`.
Which workers still answer (:func:`answering`) and why a job failed (:func:`diagnose`)
are here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from executor.client import ChannelPool, ExecutorClient, run_parallel
from executor.driver import PipelineDriver
from fusion.checkpoint import CheckpointDir
from fusion.coordinator.eligibility import CodeGate
from fusion.coordinator.memory_ledger import MemoryLedger
from fusion.coordinator.restore import (
    Holdings,
    Restored,
    RestorePoint,
    WholeState,
    choose_restore_point,
    restore_stages,
    snapshot_holdings,
)
from fusion.coordinator.store import WorkerRow
from fusion.errors import (
    CheckpointError,
    FusionError,
    InsufficientMemoryError,
    MemoryCapError,
    PoisonedInputError,
    RemoteError,
    StateError,
)
from fusion.memory import shortfall_text
from scheduler.plan import Plan

logger = logging.getLogger(__name__)

#: Recoveries one job may go through before it is failed (a fault that keeps coming back).
MAX_RECOVERIES = 20
#: How often a job waiting for workers looks for new ones.
WAIT_POLL_S = 0.5


class RecoveringJob(Protocol):
    """What :class:`Recovery` reads and changes of the job it recovers.

    :class:`~fusion.coordinator.runner.JobRunner` is the one implementation.
    """

    job_id: str
    workers: list[WorkerRow]
    """The workers the job holds: those in the plan and its spares."""
    memory: MemoryLedger
    """Measured peaks against caps, and the factor on predicted peaks."""
    stage_workers: list[WorkerRow]
    """Each stage's worker, in stage order."""
    plan: Plan
    """The current placement's plan."""
    code_gate: CodeGate
    """Leaves out of the job the workers that cannot build its model; every placement runs
    through its :meth:`~fusion.coordinator.eligibility.CodeGate.attempt`."""

    @property
    def driver(self) -> PipelineDriver:
        """The driver of the current placement."""
        ...

    def planning_set(self, workers: Sequence[WorkerRow]) -> list[WorkerRow]:
        """The workers of ``workers`` to plan over (the rest are spares)."""
        ...

    def configure(
        self,
        workers: Sequence[WorkerRow],
        *,
        why: str,
        same_stages: bool,
        replace: Mapping[str, WorkerRow] | None = None,
        note: str = "",
        held: Sequence[WorkerRow] | None = None,
    ) -> None:
        """Build and load a new driver, its stages without parameters (a restore follows)."""
        ...

    def claim(self, *, force: bool = False) -> list[WorkerRow]:
        """Take idle workers from the coordinator; returns those that joined."""
        ...

    def leaving(self) -> set[str]:
        """Ids of the job's workers that asked to leave and are not let go yet."""
        ...

    def drop(self, worker: WorkerRow, state: str) -> None:
        """Let ``worker`` go from the job, to the coordinator's ``state`` (``gone``, ``excluded``)."""
        ...

    def event(self, event: str, message: str, **extra: Any) -> None:
        """Record a job event (``fusion status``, ``metrics.jsonl``)."""
        ...

    def rewind(self, step: int) -> None:
        """Forget the job's progress from ``step`` on (it is replayed)."""
        ...

    def loss_found(self, step: int, loss: float) -> None:
        """Add to the job's loss curve the loss of a ``step`` the driver never heard end,
        read from the loss stage's snapshot (after :meth:`rewind` to the step after it)."""
        ...

    def stopping(self) -> tuple[str, str] | None:
        """``(state, reason)`` once the job is being stopped, else ``None``."""
        ...

    def wait_for(self, text: str | None) -> None:
        """Wait (``pending``) saying ``text``, or with ``None`` go back to running."""
        ...

    def checkpoint(self, step: int) -> bool:
        """Write the durable checkpoint of ``step`` from the stages' snapshots of it, and wait
        for it; whether it was written."""
        ...


class Recovery:
    """Restores a job's stages to one step after the job lost, shed or gained workers.

    Every method leaves each stage of the job's (new) driver at the step it returns, with
    the job's progress rewound to it; :attr:`count` counts the failed steps recovered from.
    """

    def __init__(
        self,
        job: RecoveringJob,
        *,
        pool: ChannelPool,
        checkpoints: CheckpointDir,
        initial: Callable[[], Mapping[str, torch.Tensor]],
    ) -> None:
        """``initial`` gives the model's state at step 0 (the last resort of a restore)."""
        self.job = job
        self.pool = pool
        self.checkpoints = checkpoints
        self.initial = initial
        self.count = 0
        #: Stage keys of the last placement that trained, while a re-placement is unfinished
        #: (a worker lost during it leaves a driver whose stages never held a step).
        self._settled_keys: list[str] | None = None
        #: Names of the workers dropped by the recovery under way, by address (its events name them).
        self._names: dict[str, str] = {}

    def recover(self, error: FusionError, failed_step: int, flagged: Mapping[str, str]) -> int:
        """Recover from ``error`` at ``failed_step``; returns the step to resume at.

        ``flagged`` are the workers reported lost meanwhile (worker id -> reason). Re-raises
        ``error`` when no worker is lost (the failure is not one recovery can mend), and
        fails the job after :data:`MAX_RECOVERIES`.
        """
        job = self.job
        t0 = time.perf_counter()
        lost = self._find_lost(error, flagged)
        over_cap = error if isinstance(error, MemoryCapError) and error.measured else None
        if not lost and over_cap is None:
            raise error
        t_found = time.perf_counter()
        self.count += 1
        if self.count > MAX_RECOVERIES:
            raise StateError(f"gave up after {MAX_RECOVERIES} recoveries; last: {failure_reason(error)}")
        dropped = [w.address for w in job.workers if w.worker_id in lost]
        self._names = {w.address: w.name for w in job.workers if w.worker_id in lost}
        for wid, (reason, state) in lost.items():
            w = next((w for w in job.workers if w.worker_id == wid), None)
            if w is None:
                continue
            job.event(
                "worker_excluded" if state == "excluded" else "worker_lost",
                reason,
                worker=w.name,
                failed_step=failed_step,
            )
            job.drop(w, state)
        if over_cap is not None:
            scale = job.memory.outgrown(over_cap)
            job.event(
                "memory_exceeded",
                f"{over_cap}; re-planning with predicted peaks scaled by {scale:.2f}",
                worker=over_cap.worker,
                stage=over_cap.stage_idx,
                measured_peak_bytes=over_cap.needed_bytes,
                cap_bytes=over_cap.cap_bytes,
                failed_step=failed_step,
            )
        if self._settled_keys is None:
            self._settled_keys = list(job.driver.stage_keys)
        old_keys = self._settled_keys
        # Snapshots are read before any worker is reloaded, from every worker still here and
        # from dropped ones that still answer (heart-beats late under load is not death).
        held = snapshot_holdings(job.job_id, [w.address for w in job.workers], self.pool, dropped=dropped)
        t_held = time.perf_counter()
        self._place(replan=over_cap is not None)
        t_placed = time.perf_counter()
        point, restored = self._restore(old_keys, held)
        self._settled_keys = None
        t_end = time.perf_counter()
        phases = {
            "find_lost_s": t_found - t0,
            "list_snapshots_s": t_held - t_found,
            "place_and_load_s": t_placed - t_held,
            "restore_s": t_end - t_placed,
        }
        if point.step > failed_step:
            # A worker lost after every stage had finished the step and snapshotted the next,
            # before the driver heard the step end: resuming after it is exact (the older
            # snapshots of the lost stage are gone: a buddy keeps one replica). The step's
            # loss was never received; the loss stage's snapshot carries it.
            self._record_unseen_loss(failed_step, restored.step_loss)
            redone = "nothing redone"
        else:
            redone = f"{failed_step - point.step} step(s) redone"
        job.event(
            "resumed_at_step",
            f"resumed at step {point.step} (failed at step {failed_step}; {redone}) "
            f"after {t_end - t0:.2f}s ({', '.join(f'{k[:-2]} {v:.2f}s' for k, v in phases.items())})",
            step=point.step,
            failed_step=failed_step,
            recover_s=round(t_end - t0, 3),
            **{k: round(v, 3) for k, v in phases.items()},
        )
        return point.step

    def _record_unseen_loss(self, step: int, loss: float | None) -> None:
        """Record the loss of a ``step`` every stage finished unseen: from the loss stage's
        snapshot (a ``loss_from_snapshot`` event), or, where it carried none, say that the
        loss is not recorded (``loss_unrecorded``)."""
        unseen = f"step {step} finished on every stage before a worker was lost"
        if loss is not None:
            message = f"{unseen}; its loss, {loss:.4f}, was read from the loss stage's snapshot"
            self.job.event("loss_from_snapshot", message, step=step, loss=loss)
            self.job.loss_found(step, loss)
            return
        self.job.event(
            "loss_unrecorded",
            f"{unseen}; its loss was never received and is not recorded (the training state is exact: "
            "every stage resumes after it)",
            step=step,
        )

    def move(self, step: int, *, exclude: set[str], why: str, let_go: Callable[[], None] | None = None) -> int:
        """Re-plan between steps without the ``exclude`` workers, nor any worker whose leave
        request arrives while it plans (:meth:`RecoveringJob.leaving`); returns the step every
        stage resumes at: ``step``, unless a snapshot of it could not be read from any holder.

        Every stage snapshots ``step`` first, so nothing is redone; the excluded workers
        stay in the job (serving their snapshots) until the caller lets them go. When the
        workers that stay cannot hold the model (or none stays), the leavers are not kept
        waiting with it:
        ``step`` is written as a durable checkpoint, ``let_go`` lets them go, and the job
        waits for memory to join (``pending``, :meth:`_replan_or_wait`), then resumes at ``step``.
        """
        job = self.job
        t0 = time.perf_counter()
        driver = job.driver
        if self._settled_keys is None:
            self._settled_keys = list(driver.stage_keys)
        old_keys = self._settled_keys
        run_parallel(
            [lambda i=i: driver.clients[i].take_snapshot(job.job_id, i, step) for i in range(len(driver.stages))],
            name="take-snapshot",
        )
        held = snapshot_holdings(job.job_id, [w.address for w in job.workers], self.pool)

        def keep() -> list[WorkerRow]:
            # Read at each try: a joiner that cannot build the model is gone after the first,
            # and a worker that asked to leave meanwhile is never placed.
            leaving = exclude | job.leaving()
            staying = [w for w in job.workers if w.worker_id not in leaving]
            if not staying:
                raise StateError("every worker of the job is leaving")
            return staying

        # Plan over the ones that stay; the leavers still serve their snapshots.
        if exclude and all(w.worker_id in exclude for w in job.workers):  # the last ones leave
            held = self._part_then_wait(step, let_go)
        else:
            try:
                job.code_gate.attempt(
                    lambda: job.configure(job.planning_set(keep()), why=why, same_stages=False, held=keep())
                )
            except InsufficientMemoryError:
                if not exclude:
                    raise
                held = self._part_then_wait(step, let_go)
        point, _ = self._restore(old_keys, held, at_most=step)
        self._settled_keys = None
        redone = "nothing redone" if point.step == step else f"{step - point.step} step(s) redone"
        job.event(
            "resumed_at_step",
            f"resumed at step {point.step} after a planned re-plan ({time.perf_counter() - t0:.2f}s, {redone})",
            step=point.step,
        )
        return point.step

    def _part_then_wait(self, step: int, let_go: Callable[[], None] | None) -> Holdings:
        """Leavers that take memory the job cannot do without: keep ``step`` on disk (the
        leavers' stages are in no other worker's memory at that step), let them go, and wait
        until the job's workers hold the model again; returns the snapshots held then."""
        job = self.job
        if job.checkpoint(step):
            job.event("handed_off", f"the state of step {step} is kept in a durable checkpoint", step=step)
        else:
            job.event(
                "handed_off",
                f"the state of step {step} could not be written to disk; the job resumes from the newest "
                "step its replicas and durable checkpoints hold",
                step=step,
            )
        if let_go is not None:
            let_go()
        self._replan_or_wait()
        return snapshot_holdings(job.job_id, [w.address for w in job.workers], self.pool)

    def resume(self) -> RestorePoint | None:
        """After a coordinator restart: restore the newest durable checkpoint, if there is one."""
        if not self.checkpoints.list():
            return None
        return self._restore(self.job.driver.stage_keys, {})[0]

    def _find_lost(self, error: FusionError, flagged: Mapping[str, str]) -> dict[str, tuple[str, str]]:
        """Workers to drop after a failed step: worker id -> (reason, new state)."""
        job = self.job
        lost: dict[str, tuple[str, str]] = {}
        if isinstance(error, PoisonedInputError):
            sender = error.sender_stage
            if 0 <= sender < len(job.stage_workers):
                w = job.stage_workers[sender]
                lost[w.worker_id] = (f"worker {w.name} ({w.address}) sent poisoned tensors: {error}", "excluded")
        for wid, reason in flagged.items():
            lost.setdefault(wid, (reason, "gone"))
        # A refused connection is a dead process; a slow answer on a loaded machine is not,
        # so it gets a second, longer chance before the worker is dropped. Workers already
        # found lost are not asked: a frozen one would hold the recovery for both deadlines.
        unknown = [w for w in job.workers if w.worker_id not in lost]
        for w, ok in zip(unknown, answering([w.address for w in unknown], self.pool, (2.0, 8.0)), strict=True):
            if not ok:
                lost.setdefault(
                    w.worker_id, (f"worker {w.name} ({w.address}) stopped answering: {failure_reason(error)}", "gone")
                )
        return lost

    def _place(self, *, replan: bool = False) -> None:
        """A new placement after the lost workers were dropped: spares step in, else (or when
        ``replan``) re-plan. A spare or joiner that cannot build the job's model is left out
        on the way, and the placement is tried again without it."""
        job = self.job
        job.claim()
        if replan:
            self._replan_or_wait()
            return
        job.code_gate.attempt(self._replace_or_replan)

    def _replace_or_replan(self) -> None:
        """Spares step in for the stages whose worker the job no longer holds, else re-plan."""
        job = self.job
        still_held = {w.worker_id for w in job.workers}
        in_plan = {w.worker_id for w in job.stage_workers}
        spares = [w for w in job.workers if w.worker_id not in in_plan]
        gone = [w for w in job.stage_workers if w.worker_id not in still_held]
        if not gone:  # only spares were lost: the stages stay where they are
            job.configure(job.stage_workers, why="replaced", same_stages=True, replace={})
            return
        if len(spares) >= len(gone):
            replace = {w.worker_id: s for w, s in zip(gone, spares, strict=False)}
            note = ", ".join(f"{w.name} → {replace[w.worker_id].name}" for w in gone) + "; "
            job.configure(job.stage_workers, why="replaced", same_stages=True, replace=replace, note=note)
            return
        self._replan_or_wait()

    def _replan_or_wait(self) -> None:
        """Re-plan onto the job's workers; while they cannot hold the model (or none is
        left), wait for workers to join, ``pending`` and saying how much memory the job
        needs and has. Nothing is lost meanwhile: the old stages' snapshots stay where they
        are, and the durable checkpoints on disk."""
        job = self.job
        waiting: str | None = None
        needed = sum(s.peak_memory_bytes or 0 for s in job.plan.stages)
        while True:
            stop = job.stopping()
            if stop is not None:
                raise StateError(stop[1])
            if job.workers:
                try:
                    job.code_gate.attempt(
                        lambda: job.configure(job.planning_set(job.workers), why="replanned", same_stages=False)
                    )
                    break
                except InsufficientMemoryError as e:
                    needed = e.needed_bytes
                    text = shortfall_text(e.needed_bytes, e.lent_bytes, e.num_workers)
            else:
                text = shortfall_text(needed, 0, 0)
            if text != waiting:
                job.wait_for(text)
                waiting = text
            while not job.claim(force=True):
                if job.stopping() is not None:
                    break
                time.sleep(WAIT_POLL_S)
            self._drop_silent()
        if waiting is not None:
            job.wait_for(None)

    def _drop_silent(self) -> None:
        """Let the job's workers that no longer answer go (they died while it waited)."""
        job = self.job
        for w, ok in zip(
            list(job.workers), answering([w.address for w in job.workers], self.pool, (2.0, 8.0)), strict=True
        ):
            if not ok:
                job.event(
                    "worker_lost",
                    f"worker {w.name} ({w.address}) stopped answering while the job waited",
                    worker=w.name,
                )
                job.drop(w, "gone")

    def _restore(
        self, old_keys: Sequence[str], held: Holdings, *, at_most: int | None = None
    ) -> tuple[RestorePoint, Restored]:
        """Bring every stage of the job's driver to the newest step they can all reach; the
        point restored, and what :func:`~fusion.coordinator.restore.restore_stages` did.

        A holder that fails a snapshot read (lost, leaving, refusing the new placement's
        credential) is named in a ``snapshot_unavailable`` event and skipped: the other
        holders are tried, and when none is left the restore point is chosen again without
        it (an older step, a durable checkpoint), so the job fails only when no copy is left."""
        job = self.job
        bad: set[Path] = set()
        names = {w.address: w.name for w in job.workers} | self._names

        def warn(address: str, reason: str) -> None:
            who = f"{names[address]} ({address})" if address in names else address
            job.event(
                "snapshot_unavailable",
                f"a snapshot could not be read from worker {who}: {reason}; trying its other copies",
                worker=names.get(address, address),
            )

        while True:
            durable = [c for c in self.checkpoints.list() if c.path not in bad]
            point = choose_restore_point(old_keys, held, durable, at_most=at_most)
            whole = WholeState(
                point,
                job_id=job.job_id,
                old_keys=old_keys,
                held=held,
                pool=self.pool,
                checkpoints=self.checkpoints,
                initial=self.initial,
                canonical=job.driver.canonical,
                warn=warn,
            )
            copies = sum(len(v) for v in held.values())
            try:
                restored = restore_stages(job.driver, point, held, whole, warn)
            except CheckpointError as e:
                if point.source == "snapshots" and sum(len(v) for v in held.values()) < copies:
                    # ``held`` lost the holders that failed: choose again among what is left.
                    logger.warning("job %s: restoring step %d failed (%s); choosing again", job.job_id, point.step, e)
                    continue
                if point.durable is None:
                    raise
                job.event("checkpoint_corrupt", f"{point.durable.path.name} failed its checks and was skipped: {e}")
                bad.add(point.durable.path)
                continue
            text = "; ".join(
                f"stage {i} ({job.stage_workers[i].name}) from {s}" for i, s in sorted(restored.sources.items())
            )
            job.event("restored_from", text, step=point.step, source=point.source)
            job.rewind(point.step)
            return point, restored


def failure_reason(e: BaseException) -> str:
    """A failure in one line: a :class:`FusionError`'s message, anything else with its type."""
    text = str(e) or type(e).__name__
    return text if isinstance(e, FusionError) else f"{type(e).__name__}: {text}"


def diagnose(e: BaseException, workers: Sequence[tuple[str, str]], pool: ChannelPool) -> str:
    """Why a job failed: :func:`failure_reason`, naming the ``(name, address)`` workers that
    no longer answer when the failure is one of fusion's (a bug needs no ping round)."""
    reason = failure_reason(e)
    if not isinstance(e, FusionError):
        return reason
    alive = answering([address for _, address in workers], pool, (1.0,))
    gone = [f"{name} ({address})" for (name, address), ok in zip(workers, alive, strict=False) if not ok]
    return f"worker {', '.join(gone)} stopped answering: {reason}" if gone else reason


def answering(addresses: Sequence[str], pool: ChannelPool, timeouts_s: Sequence[float]) -> list[bool]:
    """Which workers answer a ping (tried once per timeout, in parallel). A refused
    connection is a dead process and ends the tries at once; a slow answer on a loaded
    machine is not, so it gets the next, longer timeout."""

    def answers(address: str) -> bool:
        for timeout_s in timeouts_s:
            try:
                ExecutorClient(address, pool).ping(timeout_s=timeout_s, attempts=1)
                return True
            except RemoteError as e:
                if e.code == "UNAVAILABLE":
                    return False
            except FusionError:
                return False
        return False

    return run_parallel([lambda a=a: answers(a) for a in addresses], name="ping")
