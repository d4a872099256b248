"""Bugs found by using the product as a user, each pinned by the behaviour a user sees:
real ``fusion-coordinator`` and ``fusion-worker`` processes, the ``fusion`` CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fusion.cli.env import EXIT_BAD_INPUT
from fusion.launch import Fleet, child_env

pytestmark = pytest.mark.timeout(300)

TOKEN = "known-bugs-token-123"

JOB = """
name = "known-bugs"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 4
seq_len = 16
[train]
steps = 2
[cluster]
min_workers = 2
"""


def fusion(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "FUSION_COORDINATOR": address, "FUSION_TOKEN": TOKEN}
    return subprocess.run(
        [sys.executable, "-m", "fusion.cli.main", *args], env=env, capture_output=True, text=True, timeout=120
    )


def status(address: str, job_id: str) -> dict[str, Any]:
    r = fusion(address, "status", job_id, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A coordinator with one worker: too few for ``JOB``, which waits for a second."""
    base = tmp_path_factory.mktemp("known-bugs")
    with Fleet(base / "logs") as f:
        f.start_coordinator(token=TOKEN, state_dir=base / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)
        f.start_worker("solo", token=TOKEN, wait=False)
        f.wait_workers(["solo"])
        yield f


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_output_dir_the_coordinator_cannot_create_is_refused_at_submit(
    fleet: Fleet, tmp_path: Path, where: str
) -> None:
    if where == "proc":
        out, cause = Path("/proc/forbidden"), "No such file or directory"
    else:
        (tmp_path / "a-file").write_text("not a directory")
        out, cause = tmp_path / "a-file" / "out", "Not a directory"
    job = tmp_path / "job.toml"
    job.write_text(JOB + f"[output]\ndir = '{out}'\n")
    r = fusion(fleet.coordinator_address, "submit", str(job))
    assert r.returncode == EXIT_BAD_INPUT, (r.stdout, r.stderr)
    assert "output.dir" in r.stderr and str(out) in r.stderr and cause in r.stderr, r.stderr
    listed = fusion(fleet.coordinator_address, "jobs")
    assert "known-bugs" not in listed.stdout  # nothing was queued to wait forever


def test_an_output_dir_gone_before_the_job_starts_fails_the_job_with_the_reason(fleet: Fleet, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB + f"[output]\ndir = '{tmp_path / 'out'}'\n")
    r = fusion(fleet.coordinator_address, "submit", str(job))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[-1]
    job_dir = Path(status(fleet.coordinator_address, job_id)["output_dir"])
    assert job_dir.is_dir()  # made at submit
    job_dir.rmdir()
    job_dir.write_text("in the way")  # the runner can no longer make it
    second = fleet.start_worker("second", token=TOKEN)
    try:
        deadline = time.monotonic() + 60
        while (s := status(fleet.coordinator_address, job_id))["state"] == "pending":
            assert time.monotonic() < deadline, s
            time.sleep(0.5)
        assert s["state"] == "failed", s
        assert str(job_dir) in s["reason"] and "File exists" in s["reason"], s
        shown = fusion(fleet.coordinator_address, "status", job_id)
        assert str(job_dir) in shown.stdout, shown.stdout
    finally:
        fleet.stop(second)


def demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusion.cli.main", "demo", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_device_reaches_the_coordinator_and_the_workers(tmp_path: Path) -> None:
    r = demo("--device", "cpu", "--workers", "1", "--steps", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for log in ("coordinator.log", "worker-demo-worker-0.log"):
        command = (tmp_path / "logs" / log).read_text().splitlines()[0]
        assert command.startswith("$ ") and "--device cpu" in command, (log, command)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_demo_on_cuda_without_cuda_is_one_error_before_any_process(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = demo("--device", "cuda", "--out", str(tmp_path), timeout=60)
    assert r.returncode == EXIT_BAD_INPUT, (r.stdout, r.stderr)
    assert r.stderr.strip() == (
        "error: --device cuda: CUDA is not available on this machine; "
        "the demo runs every process here (use --device cpu)"
    )
    assert not (tmp_path / "logs").exists() and time.monotonic() - t0 < 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_worker_on_cuda_without_cuda_is_one_error_not_a_traceback() -> None:
    env = {**child_env(), "FUSION_TOKEN": TOKEN}
    r = subprocess.run(
        [sys.executable, "-m", "fusion.cli.worker", "--coordinator", "127.0.0.1:1", "--device", "cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == EXIT_BAD_INPUT, (r.stdout, r.stderr)
    assert r.stderr.strip() == "error: --device cuda: device 'cuda' requested but CUDA is not available on this worker"
