"""Workers that cannot run a job's own model code are left out of it, with an event saying why.

A real ``fusion-coordinator`` and four ``fusion-worker`` processes: ``w0`` and ``w1`` run
job owners' code (``--allow-code``, the module on their path), ``nocode`` was started
without ``--allow-code``, ``nopath`` allows code but lacks the module on its path. A
``module:factory`` job with ``leaf_modules`` trains on ``w0`` and ``w1``; one that needs
all four fails, naming the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.launch import Fleet, child_env
from tests.integration.test_coordinator import Cli, write_job

pytestmark = pytest.mark.timeout(600)

TOKEN = "own-model-token"

GATED = """
from torch import nn


class Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x  # neither tracer captures this: it needs leaf_modules


def make(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, hidden), Gate(), nn.ReLU(), nn.Linear(hidden, 4))
"""

JOB = """
    [model]
    name = "gated_models:make"
    leaf_modules = ["2"]
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
    min_workers = {min_workers}
    [plan]
    strategy = "uniform"
    [output]
    dir = "{out}"
"""


@pytest.fixture(scope="module")
def user_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("own_code")
    (d / "gated_models.py").write_text(GATED)
    return d


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, user_code: Path) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    with Fleet(base / "logs", extra_pythonpath=[str(user_code)]) as f:
        f.start_coordinator(token=TOKEN, state_dir=base / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0)
        f.start_worker("w0", token=TOKEN, allow_code=True, wait=False)
        f.start_worker("w1", token=TOKEN, allow_code=True, wait=False)
        f.start_worker("nocode", token=TOKEN, allow_code=False, wait=False)
        f.processes.env = child_env()  # the next worker's PYTHONPATH lacks the user's module
        f.start_worker("nopath", token=TOKEN, allow_code=True, wait=False)
        f.wait_workers(["w0", "w1", "nocode", "nopath"])
        yield f


@pytest.fixture(scope="module")
def cli(fleet: Fleet, user_code: Path) -> Cli:
    return Cli(fleet.coordinator_address, TOKEN, child_env([str(user_code)]))


def _left_out(status: dict[str, object]) -> dict[str, str]:
    events = status["events"]
    assert isinstance(events, list)
    return {e["worker"]: e["message"] for e in events if e.get("event") == "left_out"}


def test_job_runs_on_the_workers_that_can_run_its_code(cli: Cli, tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml", JOB.format(min_workers=2, out=tmp_path / "out"))
    s = cli.wait(cli.submit(job))
    assert s["state"] == "succeeded", s
    left_out = _left_out(s)
    assert set(left_out) == {"nocode", "nopath"}, s["events"]
    assert left_out["nocode"] == (
        "left out nocode: it was started without --allow-code, and this job's model is code (gated_models:make)"
    )
    assert "cannot import module 'gated_models'" in left_out["nopath"], left_out
    assert sorted(st["worker"] for st in s["plan"]["stages"]) == ["w0", "w1"], s
    assert (Path(s["output_dir"]) / "model.safetensors").exists()


def test_job_fails_when_too_few_workers_can_run_its_code(cli: Cli, tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml", JOB.format(min_workers=4, out=tmp_path / "out"))
    s = cli.wait(cli.submit(job))
    assert s["state"] == "failed", s
    assert "only 3 of the job's workers can run its model and cluster.min_workers is 4" in s["reason"], s
    assert "nocode: it was started without --allow-code" in s["reason"], s
