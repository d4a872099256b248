"""A volunteer's laptop sleeps through the heartbeat timeout and wakes, again and again.

A real coordinator (2 s heartbeat timeout) and three real ``fusion-worker`` processes run
a GPT-2 tiny job; a stage worker is frozen (SIGSTOP) until the coordinator declares it
gone and the job resumes without it, then thawed (SIGCONT), twice in one job. Each time
the thawed worker must come back under its own name (never two live rows with one name),
be put to work again, and the job must end with the parameters and losses of an
uninterrupted single-process run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from fusion.launch.processes import Child
from tests.integration.test_recovery import TOKEN, Job, check_exact, job_file

pytestmark = pytest.mark.timeout(900)

HEARTBEAT_TIMEOUT_S = 2.0
#: Freeze/thaw cycles in one job, and its steps (enough to outlast them).
CYCLES = 2
STEPS = 200
#: Longest a test freeze lasts once the worker was declared gone, when the job does not
#: resume without it first.
HOLD_S = 20.0
SGD = 'optimizer = "sgd"\n        lr = 0.05\n        momentum = 0.9'


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path / "logs")
    try:
        f.start_coordinator(
            token=TOKEN,
            state_dir=tmp_path / "state",
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        )
        for i in range(3):
            f.start_worker(f"w{i}", token=TOKEN, wait=False)
        f.wait_workers([f"w{i}" for i in range(3)])
        yield f
    finally:
        for proc in f.workers.values():  # a frozen process ignores SIGTERM until thawed
            _signal(proc, signal.SIGCONT)
        f.close()


def _signal(proc: Child, sig: signal.Signals) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)


def live_rows(client: CoordinatorClient, name: str) -> list[Any]:
    return [w for w in client.workers() if w.name == name and w.state in ("idle", "busy")]


#: How long a job may take to notice a frozen worker and resume without it. The driver
#: abandons its calls to a worker once the coordinator declares it lost
#: (``PipelineDriver.abandon``), so this is the heartbeat timeout and a recovery; the bound
#: is generous for a loaded 2-core machine (``test_probe_failures`` times it tighter).
RECOVER_S = 240.0


def wait_for(what: str, check: Any, timeout_s: float = RECOVER_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def events_of(job: Job, kind: str) -> list[dict[str, Any]]:
    """Every ``kind`` event of the job so far (its metrics.jsonl: the status keeps only the latest)."""
    return [e for e in job.events(job.status()) if e["event"] == kind]


def freeze_past_the_timeout(fleet: Fleet, job: Job, victim: str) -> None:
    """SIGSTOP ``victim`` until the coordinator has declared it gone and the job has resumed
    without it, or :data:`HOLD_S` after it was declared gone (a freeze during a re-plan holds
    the re-plan's calls to it until it wakes); then SIGCONT."""
    proc = fleet.workers[victim]
    resumed_before = len(events_of(job, "resumed_at_step"))
    _signal(proc, signal.SIGSTOP)
    try:
        wait_for(f"{victim} to be declared gone", lambda: not live_rows(job.client, victim))
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline and len(events_of(job, "resumed_at_step")) <= resumed_before:
            time.sleep(0.2)
    finally:
        _signal(proc, signal.SIGCONT)


def test_frozen_worker_comes_back_under_its_name_every_time(fleet: Fleet, tmp_path: Path) -> None:
    job = Job(
        fleet,
        job_file(tmp_path / "job.toml", tmp_path / "out", workers=3, joiners="always", steps=STEPS, optimizer=SGD),
    )
    job.wait_step(3)
    client = job.client
    victims = []
    for _ in range(CYCLES):
        wait_for("three stages", lambda: len(job.stage_workers()) == 3)
        victim = job.stage_workers()[1]
        victims.append(victim)
        freeze_past_the_timeout(fleet, job, victim)
        # Back under its own name, one live row, and put to work again (use_joiners = always).
        wait_for(f"{victim} to register again", lambda v=victim: len(live_rows(client, v)) == 1)
        wait_for(f"{victim} to be put to work again", lambda v=victim: v in job.stage_workers())
        job.wait_step(job.status()["step"] + 2, timeout_s=RECOVER_S)
        for name in ("w0", "w1", "w2"):
            assert len(live_rows(client, name)) == 1, [(w.name, w.worker_id, w.state) for w in client.workers()]
    s = job.wait_end(timeout_s=600.0)
    events = job.events(s)
    lost = [e["worker"] for e in events if e["event"] == "worker_lost"]
    assert lost and set(lost) <= set(victims), events
    check_exact(s, job.path)
    for name in ("w0", "w1", "w2"):
        rows = live_rows(client, name)
        assert len(rows) == 1 and rows[0].state == "idle", [(w.name, w.state) for w in client.workers()]


# --------------------------------------------------------------------------- the race, pinned
class HoldingJob:
    """Stands in for a job runner that still holds a worker the coordinator declared gone:
    what the coordinator reads of a runner (its workers) and tells it (``worker_lost``)."""

    def __init__(self, job_id: str, workers: list[Any]) -> None:
        self.job_id = job_id
        self.workers = workers
        self.lost: list[tuple[str, str]] = []

    @property
    def worker_ids(self) -> set[str]:
        return {w.worker_id for w in self.workers}

    def worker_lost(self, worker_id: str, reason: str) -> None:
        self.lost.append((worker_id, reason))


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[Any, CoordinatorClient]]:
    from fusion.coordinator.service import CoordinatorService, start_coordinator_server
    from fusion.coordinator.store import Store

    service = CoordinatorService(
        store=Store(tmp_path / "state.sqlite"), token=TOKEN, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0
    )
    server, port = start_coordinator_server(service, "127.0.0.1", 0)
    client = CoordinatorClient(f"127.0.0.1:{port}", TOKEN)
    try:
        yield service, client
    finally:
        client.close()
        server.stop(grace=None).wait()
        service.close()


def register(address: str, name: str, port: int) -> Any:
    from fusion.wire import coordinator_pb2 as cpb

    with CoordinatorClient(address, TOKEN) as c:
        return c.register(name, f"127.0.0.1:{port}", cpb.WorkerResources(num_cores=1, device="cpu"))


def test_a_worker_back_while_its_job_still_holds_it_is_not_handed_to_that_job_twice(
    coordinator: tuple[Any, CoordinatorClient],
) -> None:
    """The interleaving that failed a job with "duplicate worker name(s) ['w2']": the
    worker thaws and registers again before its job let its old row go (the job was in a
    re-plan or a recovery when the old row was declared gone)."""
    from fusion.errors import RemoteError

    service, client = coordinator
    address = client.address
    first = register(address, "w2", 9)
    other = register(address, "w1", 8)
    job = HoldingJob("job-holding", [service.store.worker(first.worker_id), service.store.worker(other.worker_id)])
    service._runners[job.job_id] = job
    for w in job.workers:
        service.store.set_worker_state(w.worker_id, "busy", job.job_id)
    try:
        # w2 freezes: only w1 heart-beats; the coordinator declares w2 gone and tells the job.
        with CoordinatorClient(address, other.session) as w1:
            wait_for("w2 to be declared gone", lambda: w1.heartbeat(other.worker_id) and not live_rows(client, "w2"))
        assert [wid for wid, _ in job.lost] == [first.worker_id]
        # A different process cannot take the live name w1 ...
        with pytest.raises(RemoteError, match="worker name 'w1' is taken by a live worker at 127.0.0.1:8") as info:
            register(address, "w1", 7)
        assert info.value.code == "FAILED_PRECONDITION"
        # ... but w2, thawed, comes back under its own name with a fresh registration.
        again = register(address, "w2", 9)
        assert again.worker_id != first.worker_id
        assert [(w.worker_id, w.state) for w in live_rows(client, "w2")] == [(again.worker_id, "idle")]
        # The job still holds the old row: it is told again, and is not handed the new one.
        assert job.lost[-1][0] == first.worker_id and "registered again" in job.lost[-1][1]
        assert service._claim_idle(job) == []
        job.workers = [w for w in job.workers if w.worker_id != first.worker_id]  # the job lets the old row go
        assert [w.worker_id for w in service._claim_idle(job)] == [again.worker_id]
        # A stale Deregister under the old id is refused and changes nothing.
        with CoordinatorClient(address, first.session) as stale:
            with pytest.raises(RemoteError, match="no longer registered: it was declared gone"):
                stale.deregister(first.worker_id, "stale")
        assert [(w.worker_id, w.state) for w in live_rows(client, "w2")] == [(again.worker_id, "busy")]
    finally:
        service._runners.pop(job.job_id, None)


def test_sends_of_a_replaced_placement_are_refused_as_stale() -> None:
    """A thawed worker's stage still sends with its placement's job key; the executors hold
    the key of the placement that replaced it and refuse, saying why, without counting it as a
    failed authentication of the address."""
    import torch

    from executor.access import ExecutorAccess
    from executor.client import ChannelPool, ExecutorClient
    from executor.server import ExecutorService, start_server
    from fusion.auth import KeyRing, new_key, wrap_job_key
    from fusion.errors import RemoteError
    from fusion.wire import tensor_pb2 as pb

    control = new_key()
    service = ExecutorService(worker_name="w3", access=ExecutorAccess(keyring=KeyRing(), control_key=control))
    server, port = start_server(service, "127.0.0.1:0")
    old_key, new_key_ = new_key(), new_key()
    service.access.add_job("job-1", wrap_job_key(control, old_key))
    service.access.add_job("job-1", wrap_job_key(control, new_key_))  # the re-plan's LoadStage
    pools = []

    def send(key: bytes) -> RemoteError:
        ring = KeyRing()
        ring.set_job("job-1", key)
        pools.append(ChannelPool(keyring=ring))
        header = pb.TransferHeader(
            job_id="job-1", stage_idx=2, src_stage_idx=1, step=5, kind=pb.TRANSFER_KIND_ACTIVATION
        )
        with pytest.raises(RemoteError) as info:
            ExecutorClient(f"127.0.0.1:{port}", pools[-1]).send(header, {"h": torch.zeros(2, 3)})
        return info.value

    try:
        stale = send(old_key)
        assert stale.code == "FAILED_PRECONDITION", stale
        assert "stale SendWhole for job 'job-1'" in str(stale) and "placement that was replaced" in str(stale)
        assert service.access.num_refused == 0
        assert send(new_key_).code == "NOT_FOUND"  # the current key passes; no stage 2 is loaded here
        assert send(new_key()).code == "UNAUTHENTICATED"  # a key that never was: a failed authentication
        service.unload("job-1")  # the thawed worker itself unloads: the old key stays stale
        assert send(old_key).code == "FAILED_PRECONDITION"
        assert service.access.num_refused == 1
    finally:
        for p in pools:
            p.close()
        server.stop(grace=None).wait()
        service.close()
