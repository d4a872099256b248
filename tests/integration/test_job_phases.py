"""A job says what is happening, on a real coordinator and real workers on loopback.

One ``fusion-coordinator`` and one ``fusion-worker`` start; a job that needs two workers is
submitted and must say that it waits for one more (``fusion status --json`` and the text);
a second worker joins and the job runs. Its planning phases must appear in the log in the
order the runner goes through them, the status document must have shown a phase while
it planned, and the plan, which puts a model of a few microseconds on one of the two
workers (splitting it would only add loopback round trips), must say why it left the
other out.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet, child_env

TOKEN = "job-phases-token-0123456789"

pytestmark = pytest.mark.timeout(300)

TINY_MODEL = """
import torch.nn as nn


def make(hidden: int = 8, num_classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
"""

#: The planning phases of a job's first plan, in order (calibration: the first job of this
#: coordinator has no calibrated profile yet).
PHASES = ["tracing", "probing links", "profiling", "calibrating", "searching", "loading stages"]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "tiny_models.py").write_text(TINY_MODEL)
    with Fleet(tmp_path / "logs", extra_pythonpath=[str(code)]) as f:
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0
        )
        f.start_worker("w0", token=TOKEN, allow_code=True)
        yield f


def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(
        textwrap.dedent(f"""
        name = "phases"
        [model]
        name = "tiny_models:make"
        [data]
        name = "shapes"
        batch_size = 8
        image_size = 8
        num_classes = 4
        num_samples = 64
        [train]
        steps = 3
        optimizer = "sgd"
        lr = 0.1
        [cluster]
        min_workers = 2
        [output]
        dir = "{tmp_path / "out"}"
    """)
    )
    return path


def wait_for(client: CoordinatorClient, job_id: str, check: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = client.status(job_id)
        if check(s):
            return s
        time.sleep(0.1)
    raise AssertionError(f"job {job_id}: condition not met in {timeout_s}s: {client.status(job_id)}")


def test_a_job_says_what_it_waits_for_how_it_plans_and_why_it_leaves_a_worker_out(fleet: Fleet, tmp_path: Path) -> None:
    client = CoordinatorClient(fleet.coordinator_address, TOKEN)
    try:
        job_id = client.submit(load_job(job_file(tmp_path)))
        s = wait_for(client, job_id, lambda s: s["waiting"] is not None)
        assert s["state"] == "pending" and s["phase"] is None
        assert s["waiting"].startswith("1 more idle worker: 1 of 2 idle (min_workers = 2)"), s["waiting"]

        env = {**child_env([]), "FUSION_COORDINATOR": fleet.coordinator_address, "FUSION_TOKEN": TOKEN}
        text = subprocess.run(
            [sys.executable, "-m", "fusion.cli.main", "status", job_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert text.returncode == 0, text.stderr
        assert "pending: waits for 1 more idle worker: 1 of 2 idle (min_workers = 2)" in text.stdout, text.stdout

        fleet.start_worker("w1", token=TOKEN, allow_code=True)
        seen_phases: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            s = client.status(job_id)
            if s["phase"] is not None:
                assert s["state"] == "planning", s
                seen_phases.append(s["phase"])
            if s["state"] in ("running", "succeeded", "failed", "cancelled"):
                break
            time.sleep(0.02)
        s = wait_for(client, job_id, lambda s: s["state"] in ("succeeded", "failed", "cancelled"), 180)
        assert s["state"] == "succeeded", s
        assert s["waiting"] is None and s["phase"] is None
        assert seen_phases and set(seen_phases) <= set(PHASES), seen_phases

        lines, _ = client.logs(job_id)
        planning = [m.group(1) for m in (re.search(r" planning: ([a-z ]+?)(?: \(|;|$)", line) for line in lines) if m]
        assert planning == PHASES, lines
        probing = next(line for line in lines if " planning: probing links" in line)
        assert "(2 workers and the driver)" in probing, probing
        searching = next(line for line in lines if " planning: searching" in line)
        assert "strategy opfence, the default [plan] strategy" in searching, searching

        stages = [st["worker"] for st in s["plan"]["stages"]]
        assert len(stages) == 1, f"the tiny model was split over {stages}; the why-line needs a worker left out"
        why = s["plan"]["why"]
        assert why.startswith(f"1 stage on {stages[0]}: splitting over 2 workers"), why
        left_out = [line for line in lines if " left_out: " in line]
        assert len(left_out) == 1 and why in left_out[0], lines
    finally:
        client.close()
