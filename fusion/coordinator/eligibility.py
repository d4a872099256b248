"""Which of a job's workers can run its model: the others are left out of it, with a reason.

A ``package.module:factory`` model is the job owner's code. A worker runs it only when it
was started with ``--allow-code`` (it says so when it registers: ``allows_code``) and the
module imports on its Python path, which shows when it first builds the model (the
``ProfileModel`` or ``LoadStage`` call fails naming the factory). Such a worker is left
out of the job — an event says why, the coordinator may give it to other jobs, this one
never takes it again — and the job is placed over the rest; it fails only when fewer than
``cluster.min_workers`` remain. That holds for every placement, not only the first: a
worker that joins mid-job is first built on when a re-plan or a recovery puts a stage on
it, so those placements run through :meth:`CodeGate.attempt` as well.
Built-in models run on every worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from fusion.config import JobSpec
from fusion.coordinator.store import WorkerRow
from fusion.errors import PlanError, RemoteError

if TYPE_CHECKING:
    from fusion.coordinator.runner import JobRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")


def code_refusal(spec: JobSpec, worker: WorkerRow) -> str | None:
    """Why ``worker`` cannot run ``spec``'s model by what it reported at registration, or ``None``."""
    if spec.model.is_builtin or worker.resources.get("allows_code", False):
        return None
    return f"it was started without --allow-code, and this job's model is code ({spec.model.name})"


def code_failure(spec: JobSpec, error: BaseException, workers: Sequence[WorkerRow]) -> tuple[WorkerRow, str] | None:
    """The worker among ``workers`` that failed to build ``spec``'s own model in ``error``
    (it cannot import the module, or refuses code), and why; ``None`` for any other error."""
    if spec.model.is_builtin or not isinstance(error, RemoteError) or not error.peer:
        return None
    worker = next((w for w in workers if w.address == error.peer), None)
    text = str(error)
    if worker is None or (f"model factory {spec.model.name!r}" not in text and "--allow-code" not in text):
        return None
    _, _, detail = text.partition("Error: ")  # the worker's own message, after the call and status
    return worker, f"it cannot build this job's model ({spec.model.name}): {detail or text}"


class CodeGate:
    """Leaves the workers that cannot run a job's model out of it, and remembers why.

    ``left_out`` maps each such worker's name to the reason, in the order they were found.
    """

    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner
        self.left_out: dict[str, str] = {}
        self._ids: set[str] = set()

    def place(self) -> None:
        """The job's first placement (measure, then plan and load) over the workers that can
        run its model, leaving out each one found unable on the way.

        Raises:
            PlanError: fewer than ``cluster.min_workers`` workers remain.
        """
        runner = self.runner
        for w in list(runner.workers):
            reason = code_refusal(runner.spec, w)
            if reason is not None:
                self._leave_out(w, reason)
        self.attempt(lambda: runner._measure(runner.workers))
        self.attempt(lambda: runner.configure(runner.planning_set(runner.workers), why="planned", same_stages=False))

    def attempt(self, place: Callable[[], T]) -> T:
        """``place()``, again after leaving out each worker that fails it by not building the
        job's model; returns what it returns.

        ``place`` is one step of placing the job (measure, plan, load stages) that reads the
        job's workers when it runs, so each try goes over the workers still in the job.

        Raises:
            PlanError: fewer than ``cluster.min_workers`` workers remain.
            FusionError: any other failure of ``place``, and every failure once the job is
                being stopped.
        """
        runner = self.runner
        while True:
            try:
                return place()
            except RemoteError as e:
                failed = code_failure(runner.spec, e, runner.workers)
                if failed is None or runner.stopping() is not None:
                    raise
                self._leave_out(*failed)

    def screen(self, claimed: Sequence[WorkerRow]) -> list[WorkerRow]:
        """Of workers claimed for the job while it runs, those that can run its model; the
        others go back to the coordinator (with an event the first time)."""
        keep: list[WorkerRow] = []
        for w in claimed:
            if w.worker_id not in self._ids:
                reason = code_refusal(self.runner.spec, w)
                if reason is None:
                    keep.append(w)
                    continue
                self._note(w, reason)
            self.runner.release(self.runner, w, "idle")
        return keep

    def _note(self, worker: WorkerRow, reason: str) -> None:
        self._ids.add(worker.worker_id)
        self.left_out[worker.name] = reason
        self.runner.event("left_out", f"left out {worker.name}: {reason}", worker=worker.name, reason=reason)

    def _leave_out(self, worker: WorkerRow, reason: str) -> None:
        runner = self.runner
        self._note(worker, reason)
        runner.drop(worker, "idle")
        need = runner.spec.cluster.min_workers
        if len(runner.workers) < need:
            why = "; ".join(f"{name}: {r}" for name, r in self.left_out.items())
            raise PlanError(
                f"only {len(runner.workers)} of the job's workers can run its model and cluster.min_workers is "
                f"{need} (left out {why}); start workers with --allow-code and {runner.spec.model.name.split(':')[0]} "
                "importable on their PYTHONPATH, or lower cluster.min_workers"
            )
