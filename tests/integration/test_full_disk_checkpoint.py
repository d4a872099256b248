"""The coordinator's disk fills up during a durable checkpoint: the checkpoint fails, the
older ones stay, the job trains on, and the next checkpoint succeeds once there is room.

Two real full disks: for :class:`~fusion.checkpoint.CheckpointDir` alone, the checkpoint's
temporary file made a symbolic link to ``/dev/full`` (every write fails with ``ENOSPC`` from
the kernel; no root needed); for a whole job, a small tmpfs mounted at the job's checkpoint
directory (root only; skipped otherwise), shrunk to leave no room for the next checkpoint,
then grown again.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fusion.checkpoint import CheckpointDir
from fusion.launch import Fleet
from tests.integration.test_recovery import TOKEN, Job, check_exact, job_file

pytestmark = pytest.mark.timeout(300)

#: Durable checkpoints every EVERY steps (wide apart: the test resizes the disk between two).
EVERY = 8
STEPS = 48
#: The keep setting of the job file (test_recovery.job_file).
KEEP = 2
#: A tmpfs with room for every checkpoint of the job (a GPT-2 tiny checkpoint is under 1 MB).
ROOMY_BYTES = 32 << 20
SGD = 'optimizer = "sgd"\n        lr = 0.05\n        momentum = 0.9'

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) for a real ENOSPC")


def fill(root: Path, step: int) -> Path:
    """Make the checkpoint of ``step`` meet a full disk: its temporary file writes to /dev/full."""
    root.mkdir(parents=True, exist_ok=True)
    link = root / f"ckpt-{step:09d}.safetensors.tmp"
    link.symlink_to("/dev/full")
    return link


@needs_dev_full
def test_a_failed_write_leaves_nothing_and_keeps_the_older_checkpoints(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "ckpt", keep=KEEP)
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    for step in (4, 8):
        ckpts.write(step, state)
    fill(ckpts.root, 12)
    with pytest.raises(OSError) as info:
        ckpts.write(12, state)
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in ckpts.root.iterdir()) == [
        "ckpt-000000004.json",
        "ckpt-000000004.safetensors",
        "ckpt-000000008.json",
        "ckpt-000000008.safetensors",
    ]
    ckpts.write(12, state)  # space is back
    assert [c.step for c in ckpts.list()] == [8, 12]
    torch.testing.assert_close(ckpts.load(ckpts.latest())["w"], state["w"])  # type: ignore[arg-type]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path / "logs")
    try:
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0
        )
        for i in range(2):
            f.start_worker(f"w{i}", token=TOKEN, wait=False)
        f.wait_workers(["w0", "w1"])
        yield f
    finally:
        f.close()


class SmallDisk:
    """A tmpfs mounted at ``path`` (root only): a disk that can be filled and given room."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._mount("-o", f"size={size_bytes}", "-t", "tmpfs", "tmpfs", str(path))

    @staticmethod
    def _mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)

    def used_bytes(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def resize(self, size_bytes: int) -> None:
        self._mount("-o", f"remount,size={size_bytes}", str(self.path))

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[Path], SmallDisk]]:
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs, and mounting one needs root")
    disks: list[SmallDisk] = []

    def mount(path: Path) -> SmallDisk:
        try:
            disks.append(SmallDisk(path, ROOMY_BYTES))
        except (subprocess.CalledProcessError, OSError) as e:
            pytest.skip(f"cannot mount a tmpfs here: {e}")
        return disks[-1]

    yield mount
    for d in disks:
        d.close()


def job_events(job: Job, kind: str) -> list[tuple[str, str]]:
    """``(kind, message)`` of the job's log lines of event ``kind``, oldest first (every one,
    not the status's latest few)."""
    lines, _ = job.client.logs(job.job_id)
    out = []
    for line in lines:
        event, _, message = line[20:].partition(": ")
        if event == kind:
            out.append((event, message))
    return out


def wait_events(job: Job, kind: str, n: int, timeout_s: float = 180.0) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = job_events(job, kind)
        if len(found) >= n:
            return found
        if job.status()["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.02)
    raise AssertionError(f"no {n} {kind} event(s): {job_events(job, kind)}; {job.status()}")


def test_a_full_disk_fails_the_checkpoint_and_the_job_trains_on(
    fleet: Fleet, small_disk: Callable[[Path], SmallDisk], tmp_path: Path
) -> None:
    path = job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, durable_every=EVERY, steps=STEPS, optimizer=SGD)
    job = Job(fleet, path)
    root = Path(job.status()["output_dir"]) / "checkpoints"
    disk = small_disk(root)  # mounted while the job plans, long before its first checkpoint
    wait_events(job, "checkpoint", 2)
    # Two checkpoints on the disk; room for half of a third: the next write meets ENOSPC.
    blob = root / f"ckpt-{2 * EVERY:09d}.safetensors"
    disk.resize(disk.used_bytes() + blob.stat().st_size // 2)
    (_, message), *_ = wait_events(job, "checkpoint_failed", 1)
    assert message.startswith(f"checkpoint at step {3 * EVERY} failed: No space left on device ("), message
    assert message.endswith(f"; keeping ckpt-{EVERY:09d}.safetensors, ckpt-{2 * EVERY:09d}.safetensors"), message
    assert sorted(p.name for p in root.iterdir()) == [
        f"ckpt-{EVERY:09d}.json",
        f"ckpt-{EVERY:09d}.safetensors",
        f"ckpt-{2 * EVERY:09d}.json",
        f"ckpt-{2 * EVERY:09d}.safetensors",
    ]  # nothing partial left, the older ones kept
    assert job.status()["state"] == "running"
    disk.resize(ROOMY_BYTES)  # space is back
    s = job.wait_end()
    written = [int(m.split("step ")[1].split(":")[0]) for _, m in job_events(job, "checkpoint")]
    assert written[:2] == [EVERY, 2 * EVERY] and 3 * EVERY not in written and written[-1] > 3 * EVERY, written
    ckpts = CheckpointDir(root)
    assert [c.step for c in ckpts.list()] == written[-2:]
    for c in ckpts.list():
        ckpts.load(c)  # whole: size and SHA-256 check out
    check_exact(s, path)
