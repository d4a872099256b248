"""Link probes that fail around a re-plan, and calls to a worker declared gone.

What the chaos harness found (issue 32), each pinned with real gRPC servers and real
``fusion-worker`` processes:

- a worker that registers again (it was frozen past the heartbeat timeout and thawed)
  while the coordinator measures links gets a new control key; the probe keys its peers
  were handed a moment before derive from the old one and must still be honoured (they
  reach ``Probe`` and nothing else), or the measurement fails with "wrong probe credential";
- a probe that fails while the job considers a joiner (an optional re-plan) keeps the
  current plan, says so, and lets the joiner go: the job never fails for it;
- a stage worker frozen past the heartbeat timeout: the driver abandons its calls to it at
  once (they would wait out their 120 s deadline), so the job resumes within seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from tests.conftest import free_port
from tests.integration.test_freeze_thaw import events_of, live_rows, wait_for
from tests.integration.test_recovery import TOKEN, Job, check_exact, job_file

pytestmark = pytest.mark.timeout(600)

SGD = 'optimizer = "sgd"\n        lr = 0.05\n        momentum = 0.9'


def test_probe_keys_of_a_replaced_control_key_still_reach_probe_only() -> None:
    """The executor re-registers (new control key) while a peer holds a probe key derived
    from the old one: the probe is served; the old key itself opens nothing else."""
    from executor.access import ExecutorAccess
    from executor.client import ChannelPool, ExecutorClient
    from executor.server import ExecutorService, start_server
    from fusion.auth import PROBE_KEY_TTL_S, KeyRing, new_key, probe_key
    from fusion.errors import RemoteError

    old_control, new_control = new_key(), new_key()
    service = ExecutorService(worker_name="w1", access=ExecutorAccess(keyring=KeyRing(), control_key=old_control))
    server, port = start_server(service, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    pools: list[ChannelPool] = []

    def client(*, probe_from: bytes | None = None, control: bytes | None = None) -> ExecutorClient:
        ring = KeyRing()
        if probe_from is not None:
            expiry = int(time.time()) + PROBE_KEY_TTL_S
            ring.set_probe(address, expiry, probe_key(probe_from, expiry))
        if control is not None:
            ring.set_control(address, control)
        pools.append(ChannelPool(keyring=ring))
        return ExecutorClient(address, pools[-1])

    try:
        peer = client(probe_from=old_control)  # handed out by the coordinator before the worker re-registered
        peer.probe(1024, attempts=1)
        service.access.set_control_key(new_control)  # the thawed worker registers again
        peer.probe(1024, attempts=1)  # the measurement under way still works ...
        peer.probe(64 << 10, attempts=1)  # ... for small and streamed probes alike
        client(probe_from=new_control).probe(1024, attempts=1)
        with pytest.raises(RemoteError, match="wrong probe credential") as info:
            client(probe_from=new_key()).probe(1024, attempts=1)  # a key that never was
        assert info.value.code == "UNAUTHENTICATED"
        with pytest.raises(RemoteError, match="wrong control credential"):
            client(control=old_control).ping(attempts=1)  # the replaced key opens nothing but Probe
        client(control=new_control).ping(attempts=1)
    finally:
        for p in pools:
            p.close()
        server.stop(grace=None).wait()
        service.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path / "logs")
    try:
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0
        )
        for i in range(2):
            f.start_worker(f"w{i}", token=TOKEN, wait=False)
        f.wait_workers(["w0", "w1"])
        yield f
    finally:
        for proc in f.workers.values():  # a frozen process ignores SIGTERM until thawed
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        f.close()


class Ghost:
    """A registration whose executor is not there (killed as it joined): it heart-beats, so
    the job claims it, and every call to its address is refused."""

    def __init__(self, coordinator: str, name: str) -> None:
        from fusion.wire import coordinator_pb2 as cpb

        with CoordinatorClient(coordinator, TOKEN) as c:
            self.registration = c.register(
                name, f"127.0.0.1:{free_port()}", cpb.WorkerResources(num_cores=1, device="cpu")
            )
        self.client = CoordinatorClient(coordinator, self.registration.session)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ghost-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(0.3):
            try:
                if not self.client.heartbeat(self.registration.worker_id):
                    return  # let go: declared gone
            except Exception:  # the coordinator is going away at the test's end
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()


def test_a_joiner_that_cannot_be_probed_keeps_the_plan(fleet: Fleet, tmp_path: Path) -> None:
    """Before the fix the job failed with "ProbeLinks ... Connection refused"."""
    job = Job(fleet, job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, joiners="always", steps=60))
    job.wait_step(5)
    before = job.stage_workers()
    ghost = Ghost(fleet.coordinator_address, "ghost")
    try:
        skipped = wait_for("the re-plan to be skipped", lambda: events_of(job, "replan_skipped"), 120.0)
    finally:
        ghost.close()
    assert "ghost" in skipped[0]["message"] and "keeping the current plan" in skipped[0]["message"], skipped
    assert skipped[0]["dropped"] == ["ghost"]
    assert job.stage_workers() == before
    s = job.wait_end(timeout_s=300.0)
    assert not events_of(job, "replanned"), job.events(s)
    assert [w.state for w in job.client.workers() if w.name == "ghost"] == ["gone"]
    check_exact(s, job.path)


def test_a_frozen_stage_worker_does_not_hold_the_job_for_the_call_deadline(fleet: Fleet, tmp_path: Path) -> None:
    """The coordinator declares a frozen stage worker gone after 3 s; the driver gives up its
    calls to it then, so the job's recovery starts within the pings that confirm the loss
    (2 s + 8 s), not after the deadline of the call in flight (35 s for WaitStep, 120 s for
    RunStep or ApplyStep)."""
    job = Job(
        fleet,
        job_file(tmp_path / "job.toml", tmp_path / "out", workers=1, joiners="never", steps=400, optimizer=SGD),
    )
    job.wait_step(5)
    assert len(job.stage_workers()) == 2
    victim = job.stage_workers()[-1]
    proc = fleet.workers[victim]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(f"{victim} to be declared gone", lambda: not live_rows(job.client, victim), 30.0)
        declared = time.monotonic()
        wait_for("the job to recover", lambda: events_of(job, "worker_lost"), 180.0)
        took_s = time.monotonic() - declared
        wait_for("the job to resume", lambda: events_of(job, "resumed_at_step"), 120.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert took_s < 22.0, f"recovery began {took_s:.0f}s after {victim} was declared gone"
    check_exact(job.wait_end(timeout_s=400.0), job.path)


def test_a_recovery_that_loses_another_worker_recovers_again(fleet: Fleet, tmp_path: Path) -> None:
    """A stage worker is killed; the recovery puts the idle worker that joined meanwhile in
    its place, and that one's executor is gone too (killed as it joined). Before the fix the
    job failed with "LoadStage ... Connection refused"; now the recovery recovers again,
    without it, and the job ends exact."""
    job = Job(
        fleet,
        job_file(tmp_path / "job.toml", tmp_path / "out", workers=1, joiners="never", steps=120, optimizer=SGD),
    )
    job.wait_step(10)
    assert len(job.stage_workers()) == 2
    ghost = Ghost(fleet.coordinator_address, "ghost")
    try:
        wait_for(
            "the ghost to be idle", lambda: [w.state for w in job.client.workers() if w.name == "ghost"] == ["idle"]
        )
        victim = job.stage_workers()[0]
        fleet.workers[victim].kill()
        s = job.wait_end(timeout_s=400.0)
    finally:
        ghost.close()
    lost = [e["worker"] for e in job.events(s) if e["event"] == "worker_lost"]
    assert victim in lost and "ghost" in lost, job.events(s)
    check_exact(s, job.path)


def test_a_full_output_disk_does_not_end_the_job(fleet: Fleet, tmp_path: Path) -> None:
    """The whole output directory is a small tmpfs, filled to the last byte while the job
    trains: the steps' metrics lines cannot be written. Before the fix the job failed with
    ENOSPC and its runner died in its own error path (the job stayed 'running' for ever);
    now it trains on, and ends with the uninterrupted run's model."""
    from safetensors.torch import load_file

    from fusion.config import load_job
    from fusion.training import build_job_model, train_reference
    from tests.integration.test_full_disk_checkpoint import ROOMY_BYTES, SmallDisk
    from tests.support.parity import assert_state_close

    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs, and mounting one needs root")
    disk = SmallDisk(tmp_path / "out", ROOMY_BYTES)
    try:
        path = job_file(tmp_path / "job.toml", tmp_path / "out", workers=2, steps=80, optimizer=SGD)
        job = Job(fleet, path)
        job.wait_step(10)
        filler = tmp_path / "out" / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
            except OSError:
                pass
            full_at = job.status()["step"]
            job.wait_step(full_at + 15)  # SQLite's progress: the state dir is elsewhere
            try:
                f.close()
            except OSError:
                pass
        filler.unlink()
        s = job.wait_end()
        assert s["state"] == "succeeded", s
        out = Path(s["output_dir"])
        spec = load_job(path)
        model = build_job_model(spec)
        model.load_state_dict(load_file(out / "model.safetensors"))
        assert_state_close(model.state_dict(), train_reference(spec).state_dict)
    finally:
        disk.close()
