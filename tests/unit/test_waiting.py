"""A job says what is happening: what a pending job waits for (store, coordinator, status
text), and why a plan leaves workers out (the scheduler's one line)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fusion.cli.main import _format_status
from fusion.config import JobSpec
from fusion.coordinator.service import CoordinatorService, waiting_for_workers
from fusion.coordinator.store import Store
from fusion.graph.export import capture
from fusion.graph.ir import OpDag
from scheduler.explain import why_left_out
from scheduler.plan import Plan
from scheduler.planner import PlanRequest, make_plan
from scheduler.topology import Topology, WorkerSpec

pytestmark = pytest.mark.timeout(120)

TOKEN = "a-token-for-waiting-tests"

#: The jobs table as coordinators before the ``waiting`` column wrote it.
OLD_JOBS_TABLE = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, state TEXT NOT NULL,
    reason TEXT, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    step INTEGER NOT NULL DEFAULT 0, steps INTEGER NOT NULL, loss REAL, samples_per_s REAL,
    output_dir TEXT NOT NULL, plan_json TEXT, workers_json TEXT
);
INSERT INTO jobs (job_id, name, spec_json, state, created_at, steps, output_dir)
    VALUES ('job-old', 'old', '{}', 'pending', 1.0, 5, '/out/job-old');
"""


def job_spec(min_workers: int) -> JobSpec:
    return JobSpec.from_toml(
        f"""
        name = "wait"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 2
        seq_len = 8
        [train]
        steps = 3
        [cluster]
        min_workers = {min_workers}
        """
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "coordinator.sqlite")
    yield s
    s.close()


def add_job(store: Store, job_id: str, min_workers: int) -> None:
    spec = job_spec(min_workers)
    store.add_job(job_id=job_id, name=spec.name, spec_json=spec.to_json(indent=None), steps=3, output_dir="/out")


def add_worker(store: Store, name: str, state: str = "idle", job_id: str | None = None) -> None:
    store.add_worker(
        worker_id=f"id-{name}", name=name, address=f"127.0.0.1:{len(name)}", resources={}, session_hash="h"
    )
    if state != "idle":
        store.set_worker_state(f"id-{name}", state, job_id)


def test_an_old_state_file_gains_the_waiting_column_and_keeps_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    db = sqlite3.connect(path)
    db.executescript(OLD_JOBS_TABLE)
    db.close()
    store = Store(path)
    try:
        job = store.job("job-old")
        assert job.waiting is None and job.name == "old" and job.steps == 5
        store.set_waiting("job-old", "2 more idle workers")
        assert store.job("job-old").waiting == "2 more idle workers"
    finally:
        store.close()
    again = Store(path)  # a second open finds the column there and leaves it
    try:
        assert again.job("job-old").waiting == "2 more idle workers"
    finally:
        again.close()


def test_set_waiting_is_cleared_when_the_job_leaves_pending(store: Store) -> None:
    add_job(store, "job-a", 1)
    assert store.job("job-a").waiting is None
    store.set_waiting("job-a", "1 more idle worker")
    assert store.job("job-a").waiting == "1 more idle worker"
    store.set_waiting("job-a", None)
    assert store.job("job-a").waiting is None
    store.set_waiting("job-a", "again")
    store.transition("job-a", "planning")
    assert store.job("job-a").waiting is None


def test_waiting_for_workers_counts_idle_and_names_what_keeps_the_others() -> None:
    from fusion.coordinator.store import WorkerRow

    def row(name: str, state: str, job_id: str | None = None) -> WorkerRow:
        return WorkerRow(name, name, "127.0.0.1:1", {}, "h", state, job_id, 0.0, 0.0)

    text = waiting_for_workers(3, [row("a", "idle"), row("b", "idle"), row("c", "busy", "job-x"), row("d", "gone")])
    assert text == "1 more idle worker: 2 of 3 idle (min_workers = 3), 1 busy with job-x"
    assert waiting_for_workers(2, []) == "2 more idle workers: 0 of 2 idle (min_workers = 2), no worker is connected"
    held = waiting_for_workers(2, [row("a", "busy", "profile-1234"), row("b", "excluded")])
    assert held == "2 more idle workers: 0 of 2 idle (min_workers = 2), 1 busy profiling, 1 excluded"


def test_the_coordinator_says_what_pending_jobs_wait_for(store: Store) -> None:
    service = CoordinatorService(store=store, token=TOKEN)  # not started: the loop is driven by hand
    try:
        add_worker(store, "w1")
        add_worker(store, "w2")
        add_worker(store, "w3", "busy", "job-other")
        add_job(store, "job-a", 3)
        add_job(store, "job-b", 1)
        service._start_pending_jobs()
        first, second = service.status(store.job("job-a")), service.status(store.job("job-b"))
        assert first["waiting"] == "1 more idle worker: 2 of 3 idle (min_workers = 3), 1 busy with job-other"
        assert second["waiting"] == "the job ahead of it (job-a) to start first"
        assert first["phase"] is None and first["state"] == "pending"
        text = _format_status(first)
        assert "pending: waits for 1 more idle worker: 2 of 3 idle (min_workers = 3)" in text
        # A job that no longer waits has no `waiting`, in the document and in the text.
        store.transition("job-a", "cancelled", "test")
        done = service.status(store.job("job-a"))
        assert done["waiting"] is None and "waits for" not in _format_status(done)
    finally:
        service.close()


def test_a_planning_job_shows_its_phase_in_the_text() -> None:
    doc = {
        "id": "job-1",
        "name": "n",
        "state": "planning",
        "reason": None,
        "step": 0,
        "steps": 3,
        "workers": [],
        "output_dir": "/out",
        "waiting": None,
        "phase": "probing links",
        "phase_elapsed_s": 4.2,
        "events": [],
    }
    assert "  planning: probing links (4s)" in _format_status(doc).splitlines()


# ------------------------------------------------------------- why a plan leaves workers out
@pytest.fixture(scope="module")
def mlp_dag() -> OpDag:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    return capture(model, (torch.randn(4, 64),)).dag


def topology(n: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> Topology:
    workers = [WorkerSpec(name=f"w{i}", cluster="c", flops=1e11) for i in range(n)]
    return Topology.from_measurements(
        workers, [[latency_s] * n for _ in range(n)], [[bandwidth_bytes_per_s] * n for _ in range(n)]
    )


def test_a_one_stage_plan_says_what_splitting_would_cost(mlp_dag: OpDag) -> None:
    plan = make_plan(mlp_dag, topology(3, 1e5, latency_s=0.05), PlanRequest(strategy="opfence", micro_batches=4))
    assert len(plan.stages) == 1
    why = plan.extra["why"]
    assert why.startswith(f"1 stage on {plan.stages[0].worker}: splitting over ")
    assert "of transfers per step" in why and "/step against" in why
    assert f"why: {why}" in plan.table()
    assert Plan.from_json(plan.to_json()).extra["why"] == why


def test_a_plan_using_every_worker_has_no_why(mlp_dag: OpDag) -> None:
    # Uniform always spreads the nodes over every worker it is given.
    plan = make_plan(mlp_dag, topology(2, 1e5), PlanRequest(strategy="uniform", micro_batches=4))
    assert len(plan.stages) == 2 and "why" not in plan.extra
    assert "why:" not in plan.table()


def test_the_why_line_trades_transfers_against_compute_as_the_estimator_priced() -> None:
    from scheduler.estimator import Estimate

    def est(step_s: float, compute: tuple[float, ...]) -> Estimate:
        return Estimate(step_s, compute, {}, {}, {}, max(compute), tuple(range(len(compute))))

    one = est(0.40, (0.10,))
    two = est(0.61, (0.06, 0.05))
    # Four micro-batches: C = 4 · (0.10 − 0.06) = 0.16 s saved; T = Δ + C = 0.21 + 0.16 = 0.37 s.
    line = why_left_out(one, ["w1"], ["w2", "w3"], micro_batches=4, wider=two, wider_workers=["w1", "w2"])
    assert line == (
        "1 stage on w1: splitting over 2 workers (w1, w2) would add 0.37 s of transfers per step "
        "for 0.16 s of compute saved (modelled 0.61 s/step against 0.4 s/step)"
    )
    two_stages = why_left_out(two, ["w1", "w2"], ["w3"], micro_batches=4, no_wider="no plan fits")
    assert two_stages == "2 stages on w1, w2; left out w3: no plan fits"
