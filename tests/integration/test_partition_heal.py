"""A partition that heals: a stage worker cut off from the coordinator and its peers for
longer than the heartbeat timeout, then reconnected.

Real processes on loopback, a real cut without root: the worker runs behind relays
(``python -m tests.support.partition_worker``) that hold every byte to and from it while a
file exists: its heartbeats, the driver's calls, its peers' sends and its own. The job must
declare it gone and resume without it; once the link is back the worker must register
again under its own name, be put to work again, and the job end exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.launch import Fleet
from tests.integration.test_freeze_thaw import HEARTBEAT_TIMEOUT_S, RECOVER_S, SGD, events_of, live_rows, wait_for
from tests.integration.test_recovery import TOKEN, Job, check_exact, job_file

pytestmark = pytest.mark.timeout(900)

VICTIM = "cut"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, Path]]:
    cut_file = tmp_path / "cut"
    f = Fleet(tmp_path / "logs")
    try:
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S
        )
        f.start_worker("w0", token=TOKEN, wait=False)
        f.start_worker(
            VICTIM,
            token=TOKEN,
            wait=False,
            module="tests.support.partition_worker",
            extra_args=["--cut-file", str(cut_file)],
        )
        f.start_worker("w2", token=TOKEN, wait=False)
        f.wait_workers(["w0", VICTIM, "w2"])
        yield f, cut_file
    finally:
        cut_file.unlink(missing_ok=True)  # heal, so the worker can leave cleanly
        f.close()


def test_a_worker_cut_off_past_the_timeout_comes_back_when_the_link_heals(
    fleet: tuple[Fleet, Path], tmp_path: Path
) -> None:
    fleet_, cut_file = fleet
    job = Job(
        fleet_,
        job_file(tmp_path / "job.toml", tmp_path / "out", workers=3, joiners="always", steps=150, optimizer=SGD),
    )
    job.wait_step(3)
    assert VICTIM in job.stage_workers(), job.stage_workers()
    client = job.client
    cut_file.touch()
    try:
        wait_for(f"{VICTIM} to be declared lost", lambda: events_of(job, "worker_lost"))
        wait_for(f"the job to resume without {VICTIM}", lambda: events_of(job, "resumed_at_step"))
        assert VICTIM not in job.stage_workers()
    finally:
        cut_file.unlink()  # the link heals
    wait_for(f"{VICTIM} to register again", lambda: len(live_rows(client, VICTIM)) == 1)
    wait_for(f"{VICTIM} to be put to work again", lambda: VICTIM in job.stage_workers(), timeout_s=RECOVER_S)
    s = job.wait_end(timeout_s=600.0)
    events = job.events(s)
    assert [e["worker"] for e in events if e["event"] == "worker_lost"] == [VICTIM], events
    check_exact(s, job.path)
    rows = live_rows(client, VICTIM)
    assert len(rows) == 1 and rows[0].state == "idle", [(w.name, w.state) for w in client.workers()]
