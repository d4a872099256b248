"""The ``fusion`` CLI against a real coordinator (and against none): one ``error: ...`` line
and one exit code per kind of error, whether the problem was found here or remotely;
``cancel`` of an ended job; the workers table."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.cli.env import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NOT_FOUND
from fusion.launch import Fleet, child_env
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(300)

TOKEN = "cli-errors-token-123"

GOOD_JOB = """
name = "waits"
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


def fusion(address: str, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "FUSION_COORDINATOR": address, "FUSION_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "fusion.cli.main", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A coordinator with one worker: too few for ``GOOD_JOB``, which stays pending."""
    base = tmp_path_factory.mktemp("cli-errors")
    with Fleet(base / "logs") as f:
        f.start_coordinator(token=TOKEN, state_dir=base / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)
        f.start_worker("solo", token=TOKEN, wait=False)
        f.wait_workers(["solo"])
        yield f


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for raw in ("INVALID_ARGUMENT", "UNAVAILABLE", "NOT_FOUND", "FAILED_PRECONDITION", " failed with ", "Error: "):
        assert raw not in lines[0], r.stderr
    return lines[0]


def test_no_coordinator_is_one_line_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    for args in (("jobs",), ("workers",), ("status", "job-x"), ("cancel", "job-x")):
        r = fusion(address, *args)
        assert r.returncode == EXIT_FAILED, (args, r.stderr)
        assert one_error_line(r) == f"error: no coordinator at {address} — is fusion-coordinator running?"


def test_bad_input_reads_the_same_found_here_or_on_the_coordinator(fleet: Fleet, tmp_path: Path) -> None:
    local = tmp_path / "local.toml"  # load_job rejects it before any call
    local.write_text("[model]\nname = 'gpt2'\npreset = 'tiny'\n[train]\nlr = -1.0\n")
    remote = tmp_path / "remote.toml"  # only the coordinator checks the model's presets
    remote.write_text("[model]\nname = 'gpt2'\npreset = 'huge'\n")
    here = fusion(fleet.coordinator_address, "submit", str(local))
    there = fusion(fleet.coordinator_address, "submit", str(remote))
    assert here.returncode == there.returncode == EXIT_BAD_INPUT, (here.stderr, there.stderr)
    assert "train.lr" in one_error_line(here)
    assert "huge" in one_error_line(there)


def test_an_unknown_job_is_not_found(fleet: Fleet) -> None:
    for args in (("status", "job-nope"), ("logs", "job-nope"), ("cancel", "job-nope")):
        r = fusion(fleet.coordinator_address, *args)
        assert r.returncode == EXIT_NOT_FOUND, (args, r.stderr)
        assert "job-nope" in one_error_line(r)


def test_cancel_of_an_ended_job_says_so_and_fails(fleet: Fleet, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(GOOD_JOB + f"[output]\ndir = '{tmp_path / 'out'}'\n")
    submitted = fusion(fleet.coordinator_address, "submit", str(job))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[-1]
    first = fusion(fleet.coordinator_address, "cancel", job_id)
    assert first.returncode == 0 and first.stdout.strip() == f"{job_id}: cancelled", first.stderr
    again = fusion(fleet.coordinator_address, "cancel", job_id)
    assert again.returncode == EXIT_FAILED
    assert one_error_line(again) == f"error: job {job_id} already cancelled; nothing to cancel"
    followed = fusion(fleet.coordinator_address, "logs", "--follow", job_id)  # ends at once, plain lines
    assert followed.returncode == 0 and "\r" not in followed.stdout + followed.stderr, followed.stderr
    assert "pending -> cancelled: cancelled by the job owner" in followed.stdout


def test_workers_table_lists_the_live_worker(fleet: Fleet) -> None:
    r = fusion(fleet.coordinator_address, "workers")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "ID", "STATE"]
    assert len(rows) == 1 and rows[0].split()[0] == "solo" and "idle" in rows[0] and "GiB" in rows[0]
    listed = fusion(fleet.coordinator_address, "workers", "--all").stdout.splitlines()
    assert [line.split()[:3] for line in listed] == [line.split()[:3] for line in [header, *rows]]  # none gone
