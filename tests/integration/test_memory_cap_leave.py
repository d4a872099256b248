"""The last worker of a job leaves with Ctrl-C: the job waits with its state on disk, then resumes.

A real ``fusion-coordinator`` and one ``fusion-worker --memory-gb`` process on loopback (the
fixtures of ``test_memory_cap.py``). The worker is stopped with SIGINT, the graceful leave:
it hands its state off and deregisters. No worker is left to hold the model, so the job
does not fail: the step it was handed off at is written as a durable checkpoint, the worker
exits at once, and the job waits ``pending``, saying it has no memory, until a worker joins;
then it resumes at that step, redoing nothing, and ends with the losses and parameters of
an uninterrupted run.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from tests.integration.test_memory_cap import CAP_GB, TOKEN, check_same_run, job_file, wait_end, wait_until
from tests.integration.test_memory_cap import fleet_of as fleet_of  # the fixture

pytestmark = pytest.mark.timeout(300)


def test_a_job_whose_last_worker_leaves_waits_and_resumes_when_a_worker_joins(
    fleet_of: Callable[[int], Fleet], tmp_path: Path
) -> None:
    fleet = fleet_of(1)
    # Long enough (about 0.2 s a step) that the job is still running when the SIGINT lands:
    # at 6 steps it could finish in the 0.1 s between the poll that saw step 2 and the leave.
    path = job_file(tmp_path / "job.toml", tmp_path / "out", n_embd=32, steps=40, workers=1)
    with CoordinatorClient(fleet.coordinator_address, TOKEN) as client:
        job_id = client.submit(load_job(path))
        left_at = wait_until(client, job_id, lambda s: s["state"] == "running" and s["step"] >= 2, 240.0)["step"]
        leaver = fleet.workers["w0"]
        leaver.send_signal(signal.SIGINT)
        assert leaver.wait(timeout=60) == 0, fleet.log_of("worker-w0")  # not held up by the wait
        s = wait_until(client, job_id, lambda s: s["state"] == "pending" and bool(s.get("waiting")), 60.0)
        print(f"waiting: {s['waiting']}")
        assert s["waiting"].startswith("needs ") and s["waiting"].endswith("has 0 B (0 workers)"), s["waiting"]

        fleet.start_worker("w1", token=TOKEN, extra_args=["--memory-gb", str(CAP_GB)])
        s = wait_end(client, job_id)
        assert s["state"] == "succeeded", s
        events = [json.loads(line) for line in (Path(s["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        events = [e for e in events if "event" in e]
        kinds = [e["event"] for e in events]
        assert "worker_leaving" in kinds and "handed_off" in kinds and "waiting_for_workers" in kinds, kinds
        resumed = [e for e in events if e["event"] == "resumed_at_step"][-1]
        assert resumed["step"] >= left_at and "nothing redone" in resumed["message"], resumed
    check_same_run(s, path)
