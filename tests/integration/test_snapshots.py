"""Snapshots over real gRPC: replication to a buddy, and what a damaged replica gets.

Two executor processes host a 2-stage GPT-2 tiny; each snapshots its stage after a step
and streams it to the other. A replica cut mid-stream, a corrupt one, or one that names a
step nobody holds is refused with a clear error, never stored, never loaded; the workers
keep serving, and restoring from a good snapshot gives back exactly the snapshotted state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
import torch

from executor.client import ChannelPool, ExecutorClient
from executor.driver import PipelineDriver, SnapshotRequest
from executor.snapshots import snapshot_chunks
from fusion.checkpoint import make_snapshot
from fusion.config import JobSpec
from fusion.coordinator.restore import RestorePoint, restore_stages, snapshot_holdings
from fusion.errors import RemoteError
from fusion.graph.export import capture
from fusion.graph.split import split_stages
from fusion.launch.executors import LocalCluster
from fusion.training import (
    build_job_dataset,
    build_job_model,
    example_micro_batch,
    job_batch,
)
from fusion.wire import executor_pb2 as epb
from scheduler.baselines import uniform_assignment

JOB = JobSpec.from_dict(
    {
        "name": "snapshots",
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 4, "micro_batches": 2, "optimizer": "adamw", "seed": 3},
    }
)
CHUNK = 4096
#: The loss of each step the fixture trains.
LOSSES: list[float] = []


@pytest.fixture(scope="module")
def driver() -> Iterator[PipelineDriver]:
    with LocalCluster(2, torch_threads=1) as workers:
        model = build_job_model(JOB)
        dataset = build_job_dataset(JOB)
        x, y = example_micro_batch(JOB, dataset)
        captured = capture(model, (x,))
        stages = split_stages(captured.dag, uniform_assignment(captured.dag, 2))
        pool = ChannelPool(chunk_bytes=CHUNK)
        d = PipelineDriver(
            job_id="snap",
            job=JOB,
            model=model,
            captured=captured,
            stages=stages,
            addresses=workers.addresses,
            example_target=y,
            pool=pool,
        )
        d.load()
        buddies = {0: workers.addresses[1], 1: workers.addresses[0]}
        for step in range(2):
            xb, yb = job_batch(JOB, dataset, step)
            stats = d.train_step(step, (xb,), yb, snapshot=SnapshotRequest(buddies=buddies) if step == 1 else None)
            LOSSES.append(stats.loss)
        yield d
        d.close()
        pool.close()


def held(d: PipelineDriver, i: int) -> set[tuple[str, int, bool]]:
    return {(s.stage_key, int(s.step), s.replica) for s in d.clients[i].list_snapshots(d.job_id)}


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def expect(call, code: grpc.StatusCode, *words: str) -> None:
    """The call fails with ``code`` and a message naming the problem (typed client or raw stub)."""
    with pytest.raises((RemoteError, grpc.RpcError)) as info:
        call()
    e = info.value
    got = e.code if isinstance(e, RemoteError) else e.code().name  # type: ignore[union-attr]
    text = str(e) if isinstance(e, RemoteError) else e.details()  # type: ignore[union-attr]
    assert got == code.name, text
    for w in words:
        assert w in text, text


def test_each_stage_holds_its_own_snapshot_and_its_peers_replica(driver: PipelineDriver) -> None:
    k0, k1 = driver.stage_keys
    wait_for(
        lambda: (
            held(driver, 0) == {(k0, 2, False), (k1, 2, True)} and held(driver, 1) == {(k1, 2, False), (k0, 2, True)}
        )
    )
    got = ExecutorClient(driver.addresses[1], driver.pool).get_snapshot(driver.job_id, k0, 2)
    assert "param/transformer.wte.weight" in got.tensors() and "optim/transformer.wte.weight/exp_avg" in got.tensors()


def test_the_loss_stages_snapshot_and_its_replica_say_the_loss_of_the_step_they_follow(
    driver: PipelineDriver,
) -> None:
    """Stage 1 computes the loss: its snapshot of step 2, and the replica its buddy holds,
    list the loss of step 1, exactly as the driver received it; stage 0's list none."""
    k0, k1 = driver.stage_keys
    wait_for(lambda: (k1, 2, True) in held(driver, 0) and (k1, 2, False) in held(driver, 1))
    listed = {(s.stage_key, s.replica): s for i in range(2) for s in driver.clients[i].list_snapshots(driver.job_id)}
    for replica in (False, True):
        assert listed[(k1, replica)].HasField("step_loss") and listed[(k1, replica)].step_loss == LOSSES[1]
        assert not listed[(k0, replica)].HasField("step_loss")


def test_a_restore_from_a_buddys_replica_reads_the_loss_stages_step_loss(driver: PipelineDriver) -> None:
    """Every stage restored at step 2, stage 1 from the replica on worker 0 (as after its own
    worker was lost): the restore gives back the step-1 loss that replica carries."""
    k0, k1 = driver.stage_keys
    wait_for(lambda: (k1, 2, True) in held(driver, 0))
    holdings = snapshot_holdings(driver.job_id, driver.addresses, driver.pool)
    holdings[(k1, 2)] = [driver.addresses[0]]  # only the buddy's replica

    def no_whole_state() -> None:
        raise AssertionError("every stage has a snapshot to restore from")

    restored = restore_stages(driver, RestorePoint(2, "snapshots"), holdings, SimpleNamespace(get=no_whole_state))  # type: ignore[arg-type]
    assert restored.step_loss == LOSSES[1]
    assert restored.sources == {0: "the snapshot on its worker", 1: f"the replica on {driver.addresses[0]}"}


def test_replica_cut_mid_stream_is_refused_and_not_stored(driver: PipelineDriver) -> None:
    client = driver.clients[1]
    snap = make_snapshot(driver.job_id, 0, driver.stage_keys[0], 99, {"param/a": torch.arange(10_000.0)})
    chunks = list(snapshot_chunks(snap, CHUNK))
    assert len(chunks) > 4
    expect(
        lambda: client.stub.PutSnapshot(iter(chunks[: len(chunks) // 2]), timeout=10),
        grpc.StatusCode.DATA_LOSS,
        "incomplete",
    )
    assert all(step != 99 for _, step, _ in held(driver, 1))


def test_corrupt_or_unannounced_replicas_are_refused(driver: PipelineDriver) -> None:
    client = driver.clients[1]
    snap = make_snapshot(driver.job_id, 0, driver.stage_keys[0], 98, {"param/a": torch.arange(10_000.0)})
    chunks = list(snapshot_chunks(snap, CHUNK))
    flipped = bytearray(chunks[2].data)
    flipped[0] ^= 0xFF
    chunks[2] = epb.SnapshotChunk(data=bytes(flipped))
    expect(lambda: client.stub.PutSnapshot(iter(chunks), timeout=10), grpc.StatusCode.DATA_LOSS, "corrupt")
    headless = [epb.SnapshotChunk(data=c.data) for c in snapshot_chunks(snap, CHUNK)]
    expect(lambda: client.stub.PutSnapshot(iter(headless), timeout=10), grpc.StatusCode.DATA_LOSS, "first chunk")
    assert all(step != 98 for _, step, _ in held(driver, 1))


def test_restore_needs_a_held_snapshot_of_that_very_stage(driver: PipelineDriver) -> None:
    expect(lambda: driver.clients[0].restore_stage(driver.job_id, 0, 7), grpc.StatusCode.NOT_FOUND, "held steps")
    # Worker 0 holds stage 1's replica at step 1 too; stage 0 is looked up by its own key.
    ExecutorClient(driver.addresses[0], driver.pool).put_snapshot(
        make_snapshot(driver.job_id, 1, driver.stage_keys[1], 1, {"param/a": torch.ones(1)})
    )
    expect(lambda: driver.clients[0].restore_stage(driver.job_id, 0, 1), grpc.StatusCode.NOT_FOUND)


def test_restore_brings_back_the_snapshotted_state_exactly(driver: PipelineDriver) -> None:
    snapshot = {k: v for k, v in driver.state_dict().items()}
    dataset = build_job_dataset(JOB)
    xb, yb = job_batch(JOB, dataset, 2)
    driver.train_step(2, (xb,), yb)
    assert any(not torch.equal(snapshot[n], v) for n, v in driver.state_dict().items())
    driver.clients[0].restore_stage(driver.job_id, 0, 2)  # its own snapshot
    driver.clients[1].restore_stage(driver.job_id, 1, 2, source_address=driver.addresses[0])  # pulled from the buddy
    for name, value in driver.state_dict().items():
        assert torch.equal(snapshot[name], value), name
    driver.train_step(2, (xb,), yb)  # and training goes on from there
