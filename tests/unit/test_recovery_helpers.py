"""Recovery's decisions and helpers: buddies, snapshot requests, liveness, when to give up."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from executor.client import ChannelPool
from executor.driver import SnapshotRequest
from fusion.checkpoint import CheckpointDir
from fusion.config import JobSpec
from fusion.coordinator import recovery as recovery_module
from fusion.coordinator.recovery import MAX_RECOVERIES, Recovery, answering
from fusion.coordinator.replicas import choose_buddies, snapshot_request
from fusion.coordinator.restore import Restored, RestorePoint
from fusion.coordinator.store import WorkerRow
from fusion.errors import FusionError, StateError
from fusion.launch.executors import LocalCluster

MBPS = 1e6 / 8


def links(table: dict[tuple[str, str], float]):
    """``link(a, b)`` as the coordinator's LinkTable answers it: (latency, bandwidth) or None."""
    return lambda a, b: (0.01, table[(a, b)]) if (a, b) in table else None


def test_buddy_is_the_fastest_other_worker() -> None:
    table = {("a", "b"): 10 * MBPS, ("a", "c"): 1000 * MBPS, ("b", "a"): 10 * MBPS, ("b", "c"): 10 * MBPS}
    assert choose_buddies(["a", "b"], ["a", "b", "c"], links(table)) == {0: "c", 1: "c"}


def test_equal_links_spread_the_replicas_round_the_ring() -> None:
    every = {(a, b): 100 * MBPS for a in "abc" for b in "abc" if a != b}
    assert choose_buddies(["a", "b", "c"], ["a", "b", "c"], links(every)) == {0: "b", 1: "c", 2: "a"}
    # Within a factor of two counts as equal: the ring order decides, not the faster link.
    every[("a", "c")] = 150 * MBPS
    assert choose_buddies(["a", "b", "c"], ["a", "b", "c"], links(every))[0] == "b"


def test_no_buddy_without_a_second_worker() -> None:
    assert choose_buddies(["a"], ["a"], links({})) == {}


def spec(replicate_every: int, durable_every: int, steps: int = 100) -> JobSpec:
    return JobSpec.from_dict(
        {
            "model": {"name": "gpt2", "preset": "tiny"},
            "train": {"steps": steps},
            "checkpoint": {"replicate_every": replicate_every, "durable_every": durable_every, "replicate_share": 0.25},
        }
    )


def test_snapshot_request_on_checkpoint_steps_only() -> None:
    s = spec(replicate_every=5, durable_every=20)
    buddies = {0: "b", 1: "a"}
    link = links({("a", "b"): 100 * MBPS, ("b", "a"): 8 * MBPS})
    assert snapshot_request(s, 0, buddies, ["a", "b"], link) is None  # step 1 is no checkpoint
    replicate = snapshot_request(s, 4, buddies, ["a", "b"], link)  # after step 5
    assert replicate == SnapshotRequest(buddies=buddies, rate_bytes_per_s=pytest.approx(0.25 * 8 * MBPS))
    s = spec(replicate_every=3, durable_every=4)
    durable_only = snapshot_request(s, 3, buddies, ["a", "b"], link)  # step 4: durable, not a replication step
    assert durable_only is not None and durable_only.buddies == {}
    assert (
        snapshot_request(spec(1, 1, steps=10), 9, buddies, ["a", "b"], link) is None
    )  # the last step: outputs are written anyway


def test_snapshot_request_unpaced_when_no_buddy_link_is_known() -> None:
    got = snapshot_request(spec(1, 50), 0, {0: "b"}, ["a"], links({}))
    assert got == SnapshotRequest(buddies={0: "b"}, rate_bytes_per_s=0.0)


def test_answering_tells_a_live_executor_from_a_closed_port(cluster: LocalCluster, port: int) -> None:
    pool = ChannelPool()
    try:
        assert answering([cluster.addresses[0], f"127.0.0.1:{port}"], pool, (2.0, 4.0)) == [True, False]
    finally:
        pool.close()


class NoWorkersLeft:
    """A job holding no workers: what :class:`Recovery` decides before it calls any of them."""

    job_id = "job"

    def __init__(self) -> None:
        self.workers: list[Any] = []
        self.stage_workers: list[Any] = []
        self.events: list[str] = []

    def event(self, event: str, message: str, **extra: Any) -> None:
        self.events.append(event)


def recovery_of(job: NoWorkersLeft, tmp_path: Path, pool: ChannelPool) -> Recovery:
    return Recovery(job, pool=pool, checkpoints=CheckpointDir(tmp_path, keep=1), initial=dict)  # type: ignore[arg-type]


def test_a_failure_without_a_lost_worker_is_not_recovered(tmp_path: Path) -> None:
    pool = ChannelPool()
    try:
        job = NoWorkersLeft()
        recovery = recovery_of(job, tmp_path, pool)
        error = FusionError("the loss is NaN")
        with pytest.raises(FusionError) as raised:
            recovery.recover(error, 3, {})
        assert raised.value is error and recovery.count == 0 and job.events == []
    finally:
        pool.close()


def test_recovery_gives_up_after_the_last_allowed_one(tmp_path: Path) -> None:
    pool = ChannelPool()
    try:
        recovery = recovery_of(NoWorkersLeft(), tmp_path, pool)
        recovery.count = MAX_RECOVERIES
        with pytest.raises(StateError, match=f"gave up after {MAX_RECOVERIES} recoveries; last: step failed"):
            recovery.recover(FusionError("step failed"), 3, {"w1": "worker w1 stopped heart-beating"})
    finally:
        pool.close()


class LostAfterItsStep(NoWorkersLeft):
    """A two-stage job whose second stage's worker died after both stages finished step 3
    and snapshotted step 4, before the driver heard the step end."""

    def __init__(self) -> None:
        super().__init__()
        self.workers = [
            WorkerRow("w1", "w1", "127.0.0.1:1", {}, "", "busy", "job", registered_at=0.0, last_heartbeat=0.0)
        ]
        self.driver = SimpleNamespace(stage_keys=["s0", "s1"], canonical=lambda name: name)
        self.rewound_to: int | None = None
        self.messages: list[str] = []
        self.extras: list[dict[str, Any]] = []
        self.found: list[tuple[int, float]] = []

    def event(self, event: str, message: str, **extra: Any) -> None:
        super().event(event, message, **extra)
        self.messages.append(message)
        self.extras.append(extra)

    def drop(self, worker: Any, state: str) -> None:
        self.workers.remove(worker)

    def rewind(self, step: int) -> None:
        self.rewound_to = step

    def loss_found(self, step: int, loss: float) -> None:
        self.found.append((step, loss))


def recover_a_step_finished_unseen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, carried_loss: float | None
) -> LostAfterItsStep:
    """Snapshots of step 4 exist for every stage, though the driver saw step 3 fail; the
    restore reads ``carried_loss`` from the loss stage's snapshot. Checks that every stage
    resumes at step 4 (exact) with nothing redone, and returns the job."""
    held = {(key, step): ["127.0.0.1:2"] for key in ("s0", "s1") for step in (3, 4)}
    held.pop(("s1", 3))  # the lost stage's older snapshot: its buddy keeps one replica
    restored_at: list[int] = []

    def restore_stages(driver: Any, point: RestorePoint, *args: Any) -> Restored:
        restored_at.append(point.step)
        return Restored({}, carried_loss)

    monkeypatch.setattr(recovery_module, "snapshot_holdings", lambda *args, **kwargs: held)
    monkeypatch.setattr(Recovery, "_place", lambda self, replan=False: None)
    monkeypatch.setattr(recovery_module, "restore_stages", restore_stages)
    pool = ChannelPool()
    try:
        job = LostAfterItsStep()
        step = recovery_of(job, tmp_path, pool).recover(FusionError("WaitStep failed"), 3, {"w1": "w1 stopped"})
    finally:
        pool.close()
    assert step == 4 and restored_at == [4] and job.rewound_to == 4
    assert "resumed at step 4 (failed at step 3; nothing redone)" in job.messages[-1], job.messages
    return job


def test_a_step_finished_unseen_is_resumed_after_and_its_loss_read_from_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = recover_a_step_finished_unseen(tmp_path, monkeypatch, 2.5)
    assert job.events[-2:] == ["loss_from_snapshot", "resumed_at_step"], job.events
    assert job.extras[-2] == {"step": 3, "loss": 2.5} and job.found == [(3, 2.5)]
    assert "step 3 finished on every stage" in job.messages[-2] and "2.5000" in job.messages[-2], job.messages


def test_a_step_finished_unseen_whose_snapshot_carries_no_loss_names_it_unrecorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss stage's snapshot from a release before snapshots carried the step loss."""
    job = recover_a_step_finished_unseen(tmp_path, monkeypatch, None)
    assert job.events[-2:] == ["loss_unrecorded", "resumed_at_step"], job.events
    assert job.extras[-2] == {"step": 3} and job.found == []
    assert "its loss was never received" in job.messages[-2], job.messages
