"""A worker that joins mid-job but cannot build the job's own model is left out; the job goes on.

A real ``fusion-coordinator`` and ``fusion-worker`` processes. A ``module:factory`` job
trains on workers that import the module. Mid-job ``nopath`` joins: started with
``--allow-code``, but without the module on its ``PYTHONPATH``, so it passes the check at
registration and fails only when a stage is loaded on it. Two placements load one there:

- a re-plan that puts the joiner to use (``use_joiners = "always"``);
- a recovery after a stage's worker is killed, where the joiner is the only worker to
  step in (``use_joiners = "never"`` keeps it idle until then).

Either way the job leaves ``nopath`` out with a ``left_out`` event saying why, carries on
with the workers it has and succeeds.

The job's model paces itself: while a gate file exists, a leaf module sleeps in every
forward, so the job cannot run out of steps before the joiner starts on a loaded machine;
the test removes the file once it has seen what it waits for, and the rest runs at speed.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet, child_env

pytestmark = pytest.mark.timeout(600)

TOKEN = "joiner-code-token"
#: Steps of the job; while the gate file exists each takes at least PACE_S, which leaves a
#: joiner over a minute to start.
STEPS = 300
PACE_S = 0.2

MODELS = """
import os
import time

from torch import nn

GATE = GATE_PATH


class Pace(nn.Module):
    def forward(self, x):
        if os.path.exists(GATE):
            time.sleep(PACE_S)
        return x


def make(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Flatten(), Pace(), nn.Linear(3 * 8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
"""


def job_file(path: Path, out: Path, *, workers: int, joiners: str, steps: int) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "joiner-code"
        [model]
        name = "joiner_models:make"
        leaf_modules = ["1"]
        [data]
        name = "shapes"
        batch_size = 8
        image_size = 8
        num_classes = 4
        num_samples = 64
        [train]
        steps = {steps}
        optimizer = "sgd"
        lr = 0.05
        [cluster]
        min_workers = {workers}
        use_joiners = "{joiners}"
        [plan]
        strategy = "uniform"
        [checkpoint]
        replicate_every = 2
        [output]
        dir = "{out}"
    """)
    )
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A coordinator and no workers yet; every process but ``nopath`` has the user's module on its path."""
    code = tmp_path / "code"
    code.mkdir()
    gate = tmp_path / "gate"
    gate.touch()
    (code / "joiner_models.py").write_text(MODELS.replace("GATE_PATH", repr(str(gate))).replace("PACE_S", str(PACE_S)))
    with Fleet(tmp_path / "logs", extra_pythonpath=[str(code)]) as f:
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0
        )
        yield f


def start_without_the_module(fleet: Fleet, name: str) -> None:
    """Start worker ``name`` with ``--allow-code`` and a ``PYTHONPATH`` that lacks the user's module."""
    env = fleet.processes.env
    fleet.processes.env = child_env()
    try:
        fleet.start_worker(name, token=TOKEN, allow_code=True)
    finally:
        fleet.processes.env = env


class Job:
    """One submitted job, watched through the coordinator's API."""

    def __init__(self, fleet: Fleet, path: Path) -> None:
        self.client = CoordinatorClient(fleet.coordinator_address, TOKEN)
        self.job_id = self.client.submit(load_job(path))

    def status(self) -> dict[str, Any]:
        return self.client.status(self.job_id)

    def wait_step(self, step: int, timeout_s: float = 240.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if s["state"] == "running" and s["step"] >= step:
                return s
            assert s["state"] not in ("succeeded", "failed", "cancelled"), f"job ended before step {step}: {s}"
            time.sleep(0.05)
        raise AssertionError(f"job did not reach step {step}: {self.status()}")

    def wait_event(self, event: str, worker: str, timeout_s: float = 240.0) -> dict[str, Any]:
        """The job's first ``event`` about ``worker``, once it is logged."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            found = [e for e in s["events"] if e.get("event") == event and e.get("worker") == worker]
            if found:
                return found[0]
            assert s["state"] not in ("succeeded", "failed", "cancelled"), f"job ended before {event} {worker}: {s}"
            time.sleep(0.1)
        raise AssertionError(f"no {event} event for {worker}: {self.status()}")

    def wait_end(self, timeout_s: float = 450.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if s["state"] in ("succeeded", "failed", "cancelled"):
                return s
            time.sleep(0.2)
        raise AssertionError(f"job did not end: {self.status()}")


def check_left_out(s: dict[str, Any], *, stages: set[str]) -> None:
    """The job succeeded on ``stages`` and left ``nopath`` out once, saying it cannot import the module."""
    assert s["state"] == "succeeded", s
    left_out = [e for e in s["events"] if e.get("event") == "left_out" and e.get("worker")]
    assert [e["worker"] for e in left_out] == ["nopath"], s["events"]
    assert left_out[0]["message"].startswith("left out nopath: it cannot build this job's model (joiner_models:make)")
    assert "cannot import module 'joiner_models'" in left_out[0]["message"], left_out
    assert {st["worker"] for st in s["plan"]["stages"]} == stages, s["plan"]
    assert (Path(s["output_dir"]) / "model.safetensors").exists()


def test_a_joiner_that_cannot_build_the_model_is_left_out_of_the_replan(fleet: Fleet, tmp_path: Path) -> None:
    for name in ("w0", "w1"):
        fleet.start_worker(name, token=TOKEN, allow_code=True, wait=False)
    fleet.wait_workers(["w0", "w1"])
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, joiners="always", steps=STEPS))
    job.wait_step(3)
    start_without_the_module(fleet, "nopath")
    job.wait_event("worker_joined", "nopath")
    job.wait_event("left_out", "nopath")
    (tmp_path / "gate").unlink()
    s = job.wait_end()
    check_left_out(s, stages={"w0", "w1"})
    assert s["step"] == STEPS


def test_a_joiner_that_cannot_build_the_model_is_left_out_of_a_recovery(fleet: Fleet, tmp_path: Path) -> None:
    for name in ("w0", "w1", "w2"):
        fleet.start_worker(name, token=TOKEN, allow_code=True, wait=False)
    fleet.wait_workers(["w0", "w1", "w2"])
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, joiners="never", steps=STEPS))
    s = job.wait_step(3)
    assert {st["worker"] for st in s["plan"]["stages"]} == {"w0", "w1", "w2"}, s["plan"]
    start_without_the_module(fleet, "nopath")  # idle: the job takes joiners only to replace a lost worker
    fleet.workers["w2"].kill()
    job.wait_event("worker_lost", "w2")
    job.wait_event("left_out", "nopath")
    (tmp_path / "gate").unlink()
    s = job.wait_end()
    check_left_out(s, stages={"w0", "w1"})
    assert s["step"] == STEPS
