"""A worker that leaves (Ctrl-C) while the job re-plans for a joiner is never placed again.

Found by the chaos soak (issue 32): a stage worker got SIGINT while the coordinator measured
links for a joiner; the joiner's re-plan still placed the leaver, the leaver (which stops
heart-beating once it asks to leave) was then declared lost, and the restore asked it for
a snapshot signed with the new placement's job key: UNAUTHENTICATED, and the job failed.
Here, with real processes: the leave arrives while the joiner is measured; the re-plan
must leave the leaver out, hand its state off, and the job must end exact.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.launch import Fleet
from tests.integration.test_recovery import TOKEN, Job, check_exact, job_file

pytestmark = pytest.mark.timeout(300)

#: How long the joiner is held still: well under the heartbeat timeout of the fleet below.
FREEZE_S = 4.0
SGD = 'optimizer = "sgd"\n        lr = 0.05\n        momentum = 0.9'


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path / "logs")
    f.start_coordinator(token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0)
    for name in ("w0", "w1"):
        f.start_worker(name, token=TOKEN, wait=False)
    f.wait_workers(["w0", "w1"])
    yield f
    f.close()


def test_worker_leaving_during_a_joiners_replan_is_not_placed(fleet: Fleet, tmp_path: Path) -> None:
    job = Job(
        fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, joiners="always", steps=300, optimizer=SGD)
    )
    job.wait_step(1)
    leaver = job.stage_workers()[1]
    fleet.start_worker("late", token=TOKEN)  # returns once it registered: the job claims it next step
    # Hold the joiner still (the probes of its links wait) while the stage worker is
    # Ctrl-C'd, so that the leave arrives while the job re-plans for the joiner.
    late = fleet.workers["late"]
    late.send_signal(signal.SIGSTOP)
    proc = fleet.workers[leaver]
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(FREEZE_S)
    finally:
        late.send_signal(signal.SIGCONT)
    s = job.wait_end()
    assert proc.wait(timeout=60) == 0
    events = job.events(s)
    joined = next(i for i, e in enumerate(events) if e["event"] == "worker_joined")
    placements = [e for e in events[joined:] if e["event"] in ("replanned", "replaced")]
    assert placements, events
    assert all(leaver not in e["stages"] for e in placements), placements
    assert "late" in placements[-1]["stages"], placements
    assert any(e["event"] == "worker_leaving" for e in events)
    assert not any(e["event"] == "worker_lost" for e in events), events
    check_exact(s, job.path)
