"""Volunteers come and go: recovery is exact, with real processes killed for real.

Each test starts a real ``fusion-coordinator`` and ``fusion-worker`` processes, submits a
GPT-2 tiny job without compression, does something to the fleet mid-job (SIGKILL a worker,
two at once, the coordinator; start a worker; Ctrl-C a worker) and checks that the job
finishes, that no more than the snapshot interval was redone, and that the final
parameters and every step's loss equal an uninterrupted single-process run with the same
seed.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from fusion.training import build_job_model, train_reference
from tests.support.parity import assert_recorded_losses, assert_state_close

TOKEN = "recovery-token"
# AdamW at lr 1e-3 for 40 steps keeps plain split-vs-single-process float drift (~6e-6) inside
# the parity tolerance; larger rates amplify last-bit differences in near-zero gradients.
REPLICATE_EVERY = 4
STEPS = 40
#: The states a job does not leave.
ENDED = ("succeeded", "failed", "cancelled")

pytestmark = pytest.mark.timeout(300)


def job_file(
    path: Path,
    out: Path,
    *,
    workers: int,
    spares: int = 0,
    durable_every: int = 1000,
    joiners: str = "never",
    steps: int = STEPS,
    optimizer: str = 'optimizer = "adamw"\n        lr = 0.001',
) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "recovery"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = {steps}
        micro_batches = 2
        {optimizer}
        seed = 7
        [cluster]
        min_workers = {workers}
        spares = {spares}
        use_joiners = "{joiners}"
        [plan]
        strategy = "uniform"
        [checkpoint]
        replicate_every = {REPLICATE_EVERY}
        durable_every = {durable_every}
        keep = 2
        [output]
        dir = "{out}"
    """)
    )
    return path


class Job:
    """A fleet, a client on the coordinator and one submitted job."""

    def __init__(self, fleet: Fleet, path: Path) -> None:
        self.fleet = fleet
        self.path = path
        self.client = CoordinatorClient(fleet.coordinator_address, TOKEN)
        self.job_id = self.client.submit(load_job(path))

    def status(self) -> dict[str, Any]:
        return self.client.status(self.job_id)

    def poll(
        self, seen: Callable[[dict[str, Any]], bool], *, every_s: float, timeout_s: float, what: str
    ) -> dict[str, Any]:
        """The job's status once ``seen`` holds of it, polled every ``every_s`` (``seen`` may
        raise to stop early); an AssertionError naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if seen(s):
                return s
            time.sleep(every_s)
        raise AssertionError(f"{what}: {self.status()}")

    def wait_step(self, step: int, timeout_s: float = 180.0) -> dict[str, Any]:
        """Wait until the job has done ``step`` steps (polls fast: steps take ~0.1s)."""

        def reached(s: dict[str, Any]) -> bool:
            if s["state"] in ENDED:
                raise AssertionError(f"job ended before step {step}: {s}")
            return s["state"] == "running" and s["step"] >= step

        return self.poll(reached, every_s=0.02, timeout_s=timeout_s, what=f"job did not reach step {step}")

    def wait_checkpoint(self, step: int, timeout_s: float = 60.0) -> None:
        """Wait until the durable checkpoint of ``step`` is written (it is written in the
        background from every stage's snapshot: a stage killed before it is fetched loses it)."""
        self.poll(
            lambda s: any(e["event"] == "checkpoint" and e.get("step") == step for e in s["events"]),
            every_s=0.05,
            timeout_s=timeout_s,
            what=f"no durable checkpoint of step {step}",
        )

    def wait_end(self, timeout_s: float = 240.0) -> dict[str, Any]:
        return self.poll(lambda s: s["state"] in ENDED, every_s=0.2, timeout_s=timeout_s, what="job did not end")

    def events(self, s: dict[str, Any]) -> list[dict[str, Any]]:
        """Events of the job's metrics.jsonl (the changes of course), in order."""
        lines = (Path(s["output_dir"]) / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "event" in r]

    def stage_workers(self) -> list[str]:
        return [st["worker"] for st in self.status()["plan"]["stages"]]


@pytest.fixture
def fleet_of(tmp_path: Path) -> Iterator[Callable[[int], Fleet]]:
    fleets: list[Fleet] = []

    def start(n: int) -> Fleet:
        f = Fleet(tmp_path / "logs")
        fleets.append(f)
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0
        )
        for i in range(n):
            f.start_worker(f"w{i}", token=TOKEN, wait=False)
        f.wait_workers([f"w{i}" for i in range(n)])
        return f

    yield start
    for f in fleets:
        f.close()


def check_exact(s: dict[str, Any], path: Path) -> None:
    """The job succeeded, and its model and losses equal an uninterrupted single-process run."""
    assert s["state"] == "succeeded", s
    out = Path(s["output_dir"])
    spec = load_job(path)
    model = build_job_model(spec)
    model.load_state_dict(load_file(out / "model.safetensors"))
    ref = train_reference(spec)
    assert_state_close(model.state_dict(), ref.state_dict)
    assert_recorded_losses(out / "metrics.jsonl", ref.losses)


def resumed(events: list[dict[str, Any]]) -> dict[str, Any]:
    found = [e for e in events if e["event"] == "resumed_at_step"]
    assert found, events
    return found[-1]


def test_killed_worker_is_replaced_by_the_spare(fleet_of: Callable[[int], Fleet], tmp_path: Path) -> None:
    fleet = fleet_of(4)
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=4, spares=1))
    job.wait_step(REPLICATE_EVERY * 3 + 2)
    plan_workers = job.stage_workers()
    assert len(plan_workers) == 3
    victim = plan_workers[1]
    fleet.workers[victim].kill()
    s = job.wait_end()
    events = job.events(s)
    r = resumed(events)
    print(f"spare: {r['message']}")
    assert r["failed_step"] - r["step"] <= REPLICATE_EVERY, r
    lost = [e for e in events if e["event"] == "worker_lost"]
    assert [e["worker"] for e in lost] == [victim]
    replaced = [e for e in events if e["event"] == "replaced"]
    assert replaced and victim not in replaced[-1]["stages"] and len(replaced[-1]["stages"]) == 3
    restored = [e for e in events if e["event"] == "restored_from"]
    # The lost stage comes back from its replica: pulled from the buddy, or already on the
    # spare when the spare was the buddy.
    assert len(restored) == 1 and restored[0]["source"] == "snapshots", restored
    check_exact(s, job.path)


def test_killed_worker_without_spare_replans_onto_the_rest(fleet_of: Callable[[int], Fleet], tmp_path: Path) -> None:
    fleet = fleet_of(4)
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=4))
    job.wait_step(REPLICATE_EVERY * 2 + 1)
    assert len(job.stage_workers()) == 4
    victim = job.stage_workers()[2]
    fleet.workers[victim].kill()
    s = job.wait_end()
    events = job.events(s)
    r = resumed(events)
    print(f"re-plan: {r['message']}")
    assert r["failed_step"] - r["step"] <= REPLICATE_EVERY, r
    replanned = [e for e in events if e["event"] == "replanned"][-1]
    assert len(replanned["stages"]) == 3 and victim not in replanned["stages"]
    check_exact(s, job.path)


def test_worker_and_its_buddy_killed_at_once_restore_from_disk(
    fleet_of: Callable[[int], Fleet], tmp_path: Path
) -> None:
    fleet = fleet_of(4)
    job = Job(
        fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=4, spares=1, durable_every=REPLICATE_EVERY * 2)
    )
    job.wait_step(REPLICATE_EVERY * 4 + 1)
    job.wait_checkpoint(REPLICATE_EVERY * 4)
    planned = next(e for e in job.status()["events"] if e["event"] == "planned")
    victim = planned["stages"][0]
    buddy = planned["buddies"][victim]
    fleet.workers[victim].kill()
    fleet.workers[buddy].kill()
    s = job.wait_end()
    events = job.events(s)
    restored = [e for e in events if e["event"] == "restored_from"][-1]
    print(f"durable: {restored['message']}")
    assert restored["source"] == "durable", restored
    assert {e["worker"] for e in events if e["event"] == "worker_lost"} == {victim, buddy}
    r = resumed(events)
    # From the newest checkpoint: the one of step 16 was on disk before the kill (one in
    # flight then is lost with the killed stage's snapshot).
    assert REPLICATE_EVERY * 4 <= r["step"] < r["failed_step"], r
    check_exact(s, job.path)


@pytest.mark.quiet  # the joiner must join before the job ends
def test_worker_joining_mid_job_is_put_to_work(fleet_of: Callable[[int], Fleet], tmp_path: Path) -> None:
    fleet = fleet_of(2)
    # Long enough (SGD keeps float drift negligible over many steps) for a worker to start.
    sgd = 'optimizer = "sgd"\n        lr = 0.05\n        momentum = 0.9'
    job = Job(
        fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, joiners="always", steps=160, optimizer=sgd)
    )
    job.wait_step(3)
    assert len(job.stage_workers()) == 2
    fleet.start_worker("late", token=TOKEN)
    s = job.wait_end()
    events = job.events(s)
    joined = [e for e in events if e["event"] == "worker_joined"]
    assert [e["worker"] for e in joined] == ["late"]
    replanned = [e for e in events if e["event"] == "replanned"][-1]
    assert "late" in replanned["stages"] and len(replanned["stages"]) == 3
    r = resumed(events)
    assert "nothing redone" in r["message"]
    check_exact(s, job.path)


def test_worker_leaving_with_ctrl_c_hands_off_its_state(fleet_of: Callable[[int], Fleet], tmp_path: Path) -> None:
    fleet = fleet_of(3)
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=3))
    job.wait_step(5)
    leaver = job.stage_workers()[1]
    assert fleet.stop(fleet.workers[leaver], grace_s=120) == 0  # SIGTERM: the worker's Ctrl-C path
    s = job.wait_end()
    events = job.events(s)
    assert any(e["event"] == "worker_leaving" for e in events)
    assert not any(e["event"] == "worker_lost" for e in events)
    replanned = [e for e in events if e["event"] == "replanned"][-1]
    assert leaver not in replanned["stages"]
    check_exact(s, job.path)


def test_coordinator_killed_and_restarted_resumes_from_its_checkpoint(
    fleet_of: Callable[[int], Fleet], tmp_path: Path
) -> None:
    fleet = fleet_of(3)
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=3, durable_every=REPLICATE_EVERY * 2))
    job.wait_step(REPLICATE_EVERY * 4 + 1)
    assert fleet.coordinator is not None
    fleet.coordinator.kill()
    fleet.coordinator.wait(timeout=10)
    port = int(fleet.coordinator_address.rsplit(":", 1)[1])
    fleet.start_coordinator(
        token=TOKEN, state_dir=tmp_path / "state", port=port, heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0
    )
    job.client = CoordinatorClient(fleet.coordinator_address, TOKEN)
    s = job.wait_end()
    events = job.events(s)
    r = resumed(events)
    print(f"restart: {r['message']}")
    assert r["step"] >= REPLICATE_EVERY * 2 and "durable checkpoint" in r["message"]
    check_exact(s, job.path)
