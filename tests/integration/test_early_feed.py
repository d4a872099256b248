"""A step's feed may come before its ``RunStep``: the driver sends both at once.

A stage between steps holds inputs and targets for one step, hands them to that step when
it starts, and refuses what it cannot place: a second copy of one, another step while one
is waiting, or anything for another step while one is running. A run of a step again after
a restore (tests/integration/test_snapshots.py) is fed the same way. A real one-stage job on
a real executor process, fed by hand before ``RunStep``, trains to the single-process loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from executor.client import ChannelPool
from executor.driver import PipelineDriver
from executor.micro_batch import TARGET_NAME
from fusion.config import JobSpec
from fusion.errors import RemoteError
from fusion.graph.export import capture
from fusion.graph.split import DRIVER, split_stages
from fusion.launch.executors import LocalCluster
from fusion.training import build_job_dataset, build_job_model, example_micro_batch, job_batch, train_reference
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 2, "micro_batches": 2, "optimizer": "sgd", "lr": 0.1},
    }
)


@pytest.fixture
def driver(cluster: LocalCluster) -> Iterator[PipelineDriver]:
    model = build_job_model(JOB)
    x, y = example_micro_batch(JOB, build_job_dataset(JOB))
    captured = capture(model, (x,))
    stages = split_stages(captured.dag, {n.name: 0 for n in captured.dag.compute_nodes()})
    pool = ChannelPool()
    d = PipelineDriver(
        job_id="early-feed",
        job=JOB,
        model=model,
        captured=captured,
        stages=stages,
        addresses=cluster.addresses[:1],
        example_target=y,
        pool=pool,
    )
    try:
        d.load()
        yield d
    finally:
        d.close()
        pool.close()


def header(driver: PipelineDriver, step: int, micro_batch_idx: int, kind: int) -> pb.TransferHeader:
    return pb.TransferHeader(
        job_id=driver.job_id, stage_idx=0, src_stage_idx=DRIVER, step=step, micro_batch_idx=micro_batch_idx, kind=kind
    )


def feed(driver: PipelineDriver, step: int, micro_batch_idx: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Send one micro-batch's inputs and targets as the driver does, by hand."""
    (name,) = [n for n, src in driver.stages[0].inputs if src == DRIVER]
    m = JOB.train.micro_batches
    client = driver.clients[0]
    client.send(
        header(driver, step, micro_batch_idx, pb.TRANSFER_KIND_ACTIVATION),
        {name: torch.chunk(x, m)[micro_batch_idx]},
    )
    client.send(
        header(driver, step, micro_batch_idx, pb.TRANSFER_KIND_TARGET),
        {TARGET_NAME: torch.chunk(y, m)[micro_batch_idx]},
    )


def test_a_feed_before_run_step_waits_for_the_step(driver: PipelineDriver) -> None:
    dataset = build_job_dataset(JOB)
    reference = train_reference(JOB, steps=2).losses
    x0, y0 = job_batch(JOB, dataset, 0)
    assert driver.train_step(0, (x0,), y0).loss == pytest.approx(reference[0], rel=1e-5)
    client = driver.clients[0]
    x1, y1 = job_batch(JOB, dataset, 1)
    for mb in range(JOB.train.micro_batches):
        feed(driver, 1, mb, x1, y1)
    with pytest.raises(RemoteError, match="already has"):
        feed(driver, 1, 0, x1, y1)
    with pytest.raises(RemoteError, match="not running step 3"):
        feed(driver, 3, 0, x1, y1)
    # The step starts with everything it needs already in: no feed follows the RunStep.
    finish = epb.StepFinish(optimizer_step=True)
    client.run_step(driver.job_id, 0, 1, JOB.train.micro_batches, epb.SCHEDULE_1F1B, finish=finish)
    result = client.wait_step(driver.job_id, 0, 1, 60.0)
    assert result.done and result.loss == pytest.approx(reference[1], rel=1e-5)
    # While a step runs, nothing for the next one is taken.
    x2, y2 = job_batch(JOB, dataset, 2)
    (name,) = [n for n, src in driver.stages[0].inputs if src == DRIVER]
    client.run_step(driver.job_id, 0, 2, JOB.train.micro_batches, epb.SCHEDULE_1F1B, finish=finish)
    with pytest.raises(RemoteError, match="not running step 3"):
        client.send(
            header(driver, 3, 0, pb.TRANSFER_KIND_ACTIVATION), {name: torch.chunk(x2, JOB.train.micro_batches)[0]}
        )
    for mb in range(JOB.train.micro_batches):
        feed(driver, 2, mb, x2, y2)
    assert client.wait_step(driver.job_id, 0, 2, 60.0).done
