"""Which workers can run a job's own model code: from registration, and from a failed build."""

from __future__ import annotations

import pytest

from fusion.config import JobSpec
from fusion.coordinator.eligibility import CodeGate, code_failure, code_refusal
from fusion.coordinator.store import WorkerRow
from fusion.errors import PlanError, RemoteError, StageError


def _worker(name: str, *, allows_code: bool) -> WorkerRow:
    resources = {"device": "cpu", **({"allows_code": True} if allows_code else {})}  # proto3 JSON drops false
    return WorkerRow(
        worker_id=f"id-{name}",
        name=name,
        address=f"{name}.example:7000",
        resources=resources,
        session_hash="",
        state="busy",
        job_id="job",
        registered_at=0.0,
        last_heartbeat=0.0,
    )


def _spec(name: str) -> JobSpec:
    return JobSpec.from_toml(f'[model]\nname = "{name}"\n[data]\nname = "shapes"\n')


def test_a_worker_without_allow_code_is_refused_only_for_code() -> None:
    plain, coder = _worker("plain", allows_code=False), _worker("coder", allows_code=True)
    own = _spec("pkg.mod:make")
    assert code_refusal(own, plain) == (
        "it was started without --allow-code, and this job's model is code (pkg.mod:make)"
    )
    assert code_refusal(own, coder) is None
    assert code_refusal(_spec("gpt2"), plain) is None


def test_a_failed_build_names_the_worker_and_its_error() -> None:
    w = _worker("w1", allows_code=True)
    own = _spec("pkg.mod:make")
    error = RemoteError(
        f"LoadStage on {w.address} failed with INVALID_ARGUMENT: ConfigError: cannot import module 'pkg.mod' "
        "for model factory 'pkg.mod:make': No module named 'pkg'",
        code="INVALID_ARGUMENT",
        peer=w.address,
    )
    found = code_failure(own, error, [_worker("w0", allows_code=True), w])
    assert found is not None
    worker, reason = found
    assert worker is w
    assert reason == (
        "it cannot build this job's model (pkg.mod:make): cannot import module 'pkg.mod' for model factory "
        "'pkg.mod:make': No module named 'pkg'"
    )


def test_other_failures_are_not_code_failures() -> None:
    w = _worker("w1", allows_code=True)
    own = _spec("pkg.mod:make")
    unrelated = RemoteError(
        f"LoadStage on {w.address} failed with UNAVAILABLE: gone", code="UNAVAILABLE", peer=w.address
    )
    assert code_failure(own, unrelated, [w]) is None
    assert code_failure(own, StageError("model factory 'pkg.mod:make'"), [w]) is None
    builtin_error = RemoteError("cannot import module for model factory 'gpt2'", peer=w.address)
    assert code_failure(_spec("gpt2"), builtin_error, [w]) is None
    elsewhere = RemoteError("cannot import module for model factory 'pkg.mod:make'", peer="10.0.0.1:1")
    assert code_failure(own, elsewhere, [w]) is None


class Job:
    """What :class:`CodeGate` reads and changes of a job: its spec, workers, log and releases."""

    def __init__(self, spec: JobSpec, workers: list[WorkerRow]) -> None:
        self.spec = spec
        self.workers = list(workers)
        self.events: list[tuple[str, str]] = []
        self.released: list[tuple[str, str]] = []
        self.stop: tuple[str, str] | None = None

    def stopping(self) -> tuple[str, str] | None:
        return self.stop

    def event(self, event: str, message: str, **extra: object) -> None:
        self.events.append((event, message))

    def release(self, runner: object, worker: WorkerRow, state: str) -> None:
        self.released.append((worker.name, state))

    def drop(self, worker: WorkerRow, state: str) -> None:
        self.workers.remove(worker)
        self.release(self, worker, state)


def _cannot_import(worker: WorkerRow) -> RemoteError:
    return RemoteError(
        f"LoadStage on {worker.address} failed with INVALID_ARGUMENT: ConfigError: cannot import module 'pkg.mod' "
        "for model factory 'pkg.mod:make': No module named 'pkg'",
        code="INVALID_ARGUMENT",
        peer=worker.address,
    )


def _min_workers(n: int) -> JobSpec:
    return JobSpec.from_toml(f'[model]\nname = "pkg.mod:make"\n[data]\nname = "shapes"\n[cluster]\nmin_workers = {n}\n')


def test_a_placement_is_tried_again_without_the_worker_that_cannot_build_the_model() -> None:
    w0, w1, joiner = (_worker(n, allows_code=True) for n in ("w0", "w1", "joiner"))
    job = Job(_min_workers(2), [w0, w1, joiner])
    gate = CodeGate(job)  # type: ignore[arg-type]
    tries: list[list[str]] = []

    def place() -> str:
        names = [w.name for w in job.workers]
        tries.append(names)
        if "joiner" in names:
            raise _cannot_import(joiner)
        return "placed"

    assert gate.attempt(place) == "placed"
    assert tries == [["w0", "w1", "joiner"], ["w0", "w1"]]
    assert job.released == [("joiner", "idle")]
    assert [e for e, _ in job.events] == ["left_out"]
    assert job.events[0][1].startswith("left out joiner: it cannot build this job's model (pkg.mod:make)")
    assert list(gate.left_out) == ["joiner"]
    # Claimed again later (the coordinator hands idle workers out), it goes back at once, unannounced.
    assert gate.screen([joiner]) == []
    assert job.released[-1] == ("joiner", "idle") and len(job.events) == 1


def test_a_placement_fails_when_too_few_workers_can_build_the_model() -> None:
    w0, joiner = _worker("w0", allows_code=True), _worker("joiner", allows_code=True)
    job = Job(_min_workers(2), [w0, joiner])
    gate = CodeGate(job)  # type: ignore[arg-type]

    def place() -> None:
        raise _cannot_import(joiner)

    with pytest.raises(PlanError, match="only 1 of the job's workers can run its model and cluster.min_workers is 2"):
        gate.attempt(place)


def test_other_failures_of_a_placement_are_not_retried() -> None:
    w0 = _worker("w0", allows_code=True)
    job = Job(_min_workers(1), [w0])
    gate = CodeGate(job)  # type: ignore[arg-type]
    calls: list[int] = []

    def place() -> None:
        calls.append(1)
        raise RemoteError(
            f"LoadStage on {w0.address} failed with UNAVAILABLE: gone", code="UNAVAILABLE", peer=w0.address
        )

    with pytest.raises(RemoteError, match="UNAVAILABLE"):
        gate.attempt(place)

    def cannot_import() -> None:
        raise _cannot_import(w0)

    job.stop = ("cancelled", "cancelled by the owner")  # a job being stopped leaves no one out
    with pytest.raises(RemoteError, match="cannot import"):
        gate.attempt(cannot_import)
    assert len(calls) == 1 and job.workers == [w0] and job.events == []
