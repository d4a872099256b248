"""The coordinator's SQLite store: the job state machine, workers, the log, restarts, threads."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.coordinator.store import JOB_STATES, TERMINAL_STATES, TRANSITIONS, Store
from fusion.errors import NotFoundError, StateError

ALLOWED = sorted((a, b) for a, targets in TRANSITIONS.items() for b in targets)
FORBIDDEN = sorted((a, b) for a, b in itertools.product(JOB_STATES, JOB_STATES) if b not in TRANSITIONS[a])


def path_to(state: str) -> list[str]:
    """States to pass through, after ``pending``, to reach ``state`` (shortest, by BFS over TRANSITIONS)."""
    parents: dict[str, str | None] = {"pending": None}
    queue = deque(["pending"])
    while queue:
        current = queue.popleft()
        for nxt in sorted(TRANSITIONS[current]):
            if nxt not in parents:
                parents[nxt] = current
                queue.append(nxt)
    assert state in parents, f"{state} is unreachable from pending"
    path: list[str] = []
    at: str | None = state
    while at is not None and at != "pending":
        path.append(at)
        at = parents[at]
    return path[::-1]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "coordinator.sqlite"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(db_path)
    yield s
    s.close()


def add_job(store: Store, job_id: str, *, steps: int = 10) -> None:
    store.add_job(
        job_id=job_id,
        name=f"name-{job_id}",
        spec_json='{"model": {"name": "gpt2"}}',
        steps=steps,
        output_dir=f"/out/{job_id}",
    )


def job_in(store: Store, job_id: str, state: str) -> None:
    """Add a job and walk it to ``state`` through allowed transitions."""
    add_job(store, job_id)
    for s in path_to(state):
        store.transition(job_id, s)
    assert store.job(job_id).state == state


def add_worker(store: Store, worker_id: str) -> None:
    store.add_worker(
        worker_id=worker_id, name=f"host-{worker_id}", address="127.0.0.1:1", resources={"cpus": 2}, session_hash="h"
    )


# ----------------------------------------------------------------- state machine


def test_state_machine_shape() -> None:
    assert set(JOB_STATES) == {
        "pending",
        "planning",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    }  # the `fusion status` contract
    assert set(TRANSITIONS) == set(JOB_STATES)
    assert all(targets <= set(JOB_STATES) for targets in TRANSITIONS.values())
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset(), f"terminal state {state} must have no way out"
    for state in JOB_STATES:
        path_to(state)  # every state is reachable from pending


@pytest.mark.parametrize(("src", "dst"), ALLOWED, ids=[f"{a}->{b}" for a, b in ALLOWED])
def test_allowed_transition(store: Store, src: str, dst: str) -> None:
    job_in(store, "j", src)
    row = store.transition("j", dst)
    assert row.state == dst
    assert store.job("j").state == dst
    events = [r for _, _, _, r in store.log_records("j", kind="event") if r.get("event") == "state"]
    assert events[-1]["state"] == dst
    assert f"{src} -> {dst}" in events[-1]["message"]


@pytest.mark.parametrize(("src", "dst"), FORBIDDEN, ids=[f"{a}->{b}" for a, b in FORBIDDEN])
def test_forbidden_transition(store: Store, src: str, dst: str) -> None:
    job_in(store, "j", src)
    before = store.job("j")
    num_records = len(store.log_records("j"))
    with pytest.raises(StateError, match=f"from {src} to {dst}"):
        store.transition("j", dst, "should not stick")
    after = store.job("j")
    assert after == before  # nothing changed, not even the reason
    assert len(store.log_records("j")) == num_records


def test_timestamps_follow_the_lifecycle(store: Store) -> None:
    add_job(store, "j")
    row = store.job("j")
    assert row.created_at > 0 and row.started_at is None and row.finished_at is None
    row = store.transition("j", "planning")
    assert row.started_at is None and row.finished_at is None
    row = store.transition("j", "running")
    assert row.started_at is not None and row.started_at >= row.created_at
    assert row.finished_at is None
    row = store.transition("j", "succeeded")
    assert row.finished_at is not None and row.finished_at >= row.started_at


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES))
def test_every_terminal_state_sets_finished_at(store: Store, terminal: str) -> None:
    job_in(store, "j", terminal)
    assert store.job("j").finished_at is not None


def test_failing_before_running_leaves_started_at_unset(store: Store) -> None:
    add_job(store, "j")
    row = store.transition("j", "failed", "no workers")
    assert row.started_at is None and row.finished_at is not None


def test_reason_is_kept(store: Store) -> None:
    job_in(store, "j", "running")
    assert store.job("j").reason is None
    row = store.transition("j", "failed", "worker w1 stopped heart-beating")
    assert row.reason == "worker w1 stopped heart-beating"
    assert store.job("j").reason == "worker w1 stopped heart-beating"
    last = store.log_records("j", kind="event")[-1][3]
    assert "worker w1 stopped heart-beating" in last["message"]


def test_new_job_defaults(store: Store) -> None:
    add_job(store, "j", steps=42)
    row = store.job("j")
    assert (row.state, row.step, row.steps, row.loss, row.samples_per_s) == ("pending", 0, 42, None, None)
    assert row.output_dir == "/out/j" and row.name == "name-j"
    assert row.workers == []
    assert store.log_records("j")[0][3]["event"] == "submitted"


def test_progress_and_plan(store: Store) -> None:
    add_job(store, "j")
    store.set_plan("j", {"strategy": "uniform", "stages": []}, ["w-a", "w-b"])
    store.set_progress("j", step=3, loss=2.5, samples_per_s=12.0)
    row = store.job("j")
    assert row.workers == ["w-a", "w-b"]
    assert row.plan_json is not None and '"uniform"' in row.plan_json
    assert (row.step, row.loss, row.samples_per_s) == (3, 2.5, 12.0)


def test_jobs_filter_by_state_oldest_first(store: Store) -> None:
    job_in(store, "a", "running")
    job_in(store, "b", "pending")
    job_in(store, "c", "running")
    assert [j.job_id for j in store.jobs()] == ["a", "b", "c"]
    assert [j.job_id for j in store.jobs("running")] == ["a", "c"]
    assert [j.job_id for j in store.jobs("pending", "running")] == ["a", "b", "c"]
    assert store.jobs("succeeded") == []


# ----------------------------------------------------------------- not found


def test_unknown_job_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError, match="nope"):
        store.job("nope")
    with pytest.raises(NotFoundError, match="nope"):
        store.transition("nope", "planning")


def test_unknown_worker_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError, match="ghost"):
        store.worker("ghost")


# ----------------------------------------------------------------- workers


def test_worker_registration(store: Store) -> None:
    add_worker(store, "w1")
    w = store.worker("w1")
    assert (w.name, w.address, w.resources, w.state, w.job_id) == ("host-w1", "127.0.0.1:1", {"cpus": 2}, "idle", None)
    store.set_worker_state("w1", "busy", "j")
    w = store.worker("w1")
    assert (w.state, w.job_id) == ("busy", "j")
    with pytest.raises(ValueError, match="sleeping"):
        store.set_worker_state("w1", "sleeping")


def test_workers_filter_by_state(store: Store) -> None:
    for w in ("w1", "w2", "w3"):
        add_worker(store, w)
    store.set_worker_state("w2", "busy", "j")
    store.set_worker_state("w3", "gone")
    assert [w.worker_id for w in store.workers()] == ["w1", "w2", "w3"]
    assert [w.worker_id for w in store.workers("idle", "busy")] == ["w1", "w2"]
    assert [w.worker_id for w in store.workers("gone")] == ["w3"]


def test_heartbeat(store: Store) -> None:
    assert store.heartbeat("ghost") is False
    add_worker(store, "w1")
    first = store.worker("w1").last_heartbeat
    assert store.heartbeat("w1") is True
    assert store.worker("w1").last_heartbeat >= first
    store.set_worker_state("w1", "gone")
    before = store.worker("w1").last_heartbeat
    assert store.heartbeat("w1") is False
    assert store.worker("w1").last_heartbeat == before  # a gone worker is not revived by a late heartbeat


# ----------------------------------------------------------------- log


def test_log_records_order_and_filters(store: Store) -> None:
    add_job(store, "j")
    add_job(store, "other")
    seqs = []
    for i in range(5):
        seqs.append(store.log("j", "metric", {"step": i, "loss": 1.0 / (i + 1)}))
        store.log("other", "metric", {"step": i})
    seqs.append(store.log("j", "event", {"event": "note", "message": "hello"}))

    records = store.log_records("j")
    got_seqs = [r[0] for r in records]
    assert got_seqs == sorted(got_seqs) and len(set(got_seqs)) == len(got_seqs)
    assert records[0][3]["event"] == "submitted"
    assert [r[0] for r in records[1:]] == seqs
    assert all(r[1] > 0 for r in records)

    metrics = store.log_records("j", kind="metric")
    assert [r[3]["step"] for r in metrics] == [0, 1, 2, 3, 4]
    assert all(kind == "metric" for _, _, kind, _ in metrics)
    assert [r[3].get("event") for r in store.log_records("j", kind="event")] == ["submitted", "note"]

    after = store.log_records("j", after_seq=seqs[2])
    assert [r[0] for r in after] == seqs[3:]
    assert [r[3]["step"] for r in store.log_records("j", after_seq=seqs[2], kind="metric")] == [3, 4]
    assert store.log_records("j", after_seq=seqs[-1]) == []
    assert store.log_records("no-such-job") == []


# ----------------------------------------------------------------- restart


@pytest.mark.parametrize("clean_shutdown", [True, False], ids=["closed", "crashed"])
def test_restart_keeps_finished_jobs_and_logs(db_path: Path, clean_shutdown: bool) -> None:
    first = Store(db_path)
    job_in(first, "done", "running")
    first.set_plan("done", {"strategy": "uniform"}, ["w-a"])
    for step in range(1, 4):
        first.log("done", "metric", {"step": step, "loss": 4.0 - step})
        first.set_progress("done", step=step, loss=4.0 - step, samples_per_s=8.0)
    finished = first.transition("done", "succeeded")
    job_in(first, "bad", "running")
    first.transition("bad", "failed", "out of memory on w-a")
    add_worker(first, "w-a")
    records = first.log_records("done")
    if clean_shutdown:
        first.close()

    second = Store(db_path)  # the coordinator came back
    try:
        row = second.job("done")
        assert row == finished
        assert (row.state, row.step, row.loss, row.workers) == ("succeeded", 3, 1.0, ["w-a"])
        assert second.log_records("done") == records
        assert [r[3]["step"] for r in second.log_records("done", kind="metric")] == [1, 2, 3]
        assert second.job("bad").reason == "out of memory on w-a"
        assert second.worker("w-a").name == "host-w-a"
        # new records continue the sequence
        seq = second.log("done", "event", {"event": "note"})
        assert seq > records[-1][0]
    finally:
        second.close()
        if not clean_shutdown:
            first.close()


def test_recover_after_restart(db_path: Path) -> None:
    first = Store(db_path)
    for state in JOB_STATES:
        job_in(first, state, state)
    for w in ("w1", "w2", "w3"):
        add_worker(first, w)
    first.set_worker_state("w2", "busy", "running")
    first.set_worker_state("w3", "gone")
    before = {j.job_id: j for j in first.jobs()}
    first.close()

    second = Store(db_path)
    try:
        requeued = second.recover()
        assert sorted(requeued) == ["planning", "running"]
        for job_id in ("planning", "running"):
            row = second.job(job_id)
            assert row.state == "pending"
            assert row.reason is not None and "restart" in row.reason
            assert row.finished_at is None
            assert "restart" in second.log_records(job_id, kind="event")[-1][3]["message"]
        for job_id in ("pending", "succeeded", "failed", "cancelled"):
            assert second.job(job_id) == before[job_id], f"{job_id} job changed on recover"
        workers = second.workers()
        assert [w.worker_id for w in workers] == ["w1", "w2", "w3"]
        assert all(w.state == "gone" and w.job_id is None for w in workers)
        assert second.heartbeat("w1") is False  # must re-register
        assert second.recover() == []  # idempotent
    finally:
        second.close()


def test_checkpoint_records_keep_the_newest(db_path: Path) -> None:
    store = Store(db_path)
    try:
        job_in(store, "running", "running")
        for step in (10, 20, 30, 40):
            store.add_checkpoint("running", step=step, path=f"/ck/{step}", sha256="ab" * 32, size_bytes=step, keep=3)
        assert [c[0] for c in store.checkpoints("running")] == [20, 30, 40]
        assert store.checkpoints("pending") == []
    finally:
        store.close()


# ----------------------------------------------------------------- threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "store-per-thread"])
def test_concurrent_log_writers_lose_nothing(db_path: Path, shared: bool) -> None:
    num_threads, per_thread = 8, 200
    main = Store(db_path)
    add_job(main, "j")
    stores = [main] * num_threads if shared else [Store(db_path) for _ in range(num_threads)]
    seqs: list[list[int]] = [[] for _ in range(num_threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def write(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                seqs[t].append(stores[t].log("j", "metric", {"thread": t, "i": i}))
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert errors == []
        records = main.log_records("j", kind="metric")
        assert len(records) == num_threads * per_thread
        assert sorted((r[3]["thread"], r[3]["i"]) for r in records) == [
            (t, i) for t in range(num_threads) for i in range(per_thread)
        ]
        all_seqs = [s for per in seqs for s in per]
        assert sorted(all_seqs) == [r[0] for r in records]  # every returned seq is a distinct stored row
        for t in range(num_threads):  # each writer's records are in its own order
            assert [r[3]["i"] for r in records if r[3]["thread"] == t] == list(range(per_thread))
    finally:
        for s in set(stores) | {main}:
            s.close()


@pytest.mark.timeout(60)
def test_concurrent_transitions_only_one_wins(store: Store) -> None:
    add_job(store, "j")
    num_threads = 8
    outcomes: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(num_threads)

    def claim() -> None:
        barrier.wait()
        try:
            store.transition("j", "planning")
            result = "ok"
        except StateError:
            result = "refused"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=claim) for _ in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(outcomes) == ["ok"] + ["refused"] * (num_threads - 1)
    assert store.job("j").state == "planning"
