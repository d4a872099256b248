"""Tied parameters: the holders exchange gradients directly and each keeps the same sum.

GPT-2 ties its token embedding (first stage) to its output head (last stage). After a
step, ``SyncTied`` must leave both holders with bit-identical gradients equal to the sum
of what each computed, added in stage order; the bytes go between the holders.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from executor.client import ChannelPool
from executor.driver import PipelineDriver, SnapshotRequest, tied_holders
from fusion.config import JobSpec
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
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 2, "optimizer": "sgd", "lr": 0.1},
    }
)


def three_stage_driver(job_id: str, cluster: LocalCluster, pool: ChannelPool) -> PipelineDriver:
    """JOB split evenly over three of the cluster's workers (not loaded): the token
    embedding on stage 0, the head tied to it on stage 2."""
    model = build_job_model(JOB)
    x, y = example_micro_batch(JOB, build_job_dataset(JOB))
    captured = capture(model, (x,))
    return PipelineDriver(
        job_id=job_id,
        job=JOB,
        model=model,
        captured=captured,
        stages=split_stages(captured.dag, uniform_assignment(captured.dag, 3)),
        addresses=cluster.addresses[:3],
        example_target=y,
        pool=pool,
    )


def test_holders_exchange_and_sum_in_stage_order(cluster: LocalCluster) -> None:
    dataset = build_job_dataset(JOB)
    pool = ChannelPool()
    try:
        driver = three_stage_driver("tied-sync", cluster, pool)
        holders = tied_holders(driver.stages, driver.dag.tied_params)
        assert holders == {"transformer.wte.weight": [(0, "transformer.wte.weight"), (2, "lm_head.weight")]}
        try:
            driver.load()
            bx, by = job_batch(JOB, dataset, 0)
            driver.forward_backward(0, (bx,), by)
            grad = lambda s, n: driver.clients[s].get_state(driver.job_id, s, epb.STATE_KIND_GRADIENTS, [n])[n]  # noqa: E731
            before = [grad(0, "transformer.wte.weight"), grad(2, "lm_head.weight")]
            assert not torch.equal(before[0], before[1])
            # Each waits for the other's gradient: the two calls must run at once (as the driver makes them).
            with ThreadPoolExecutor(2) as ex:
                sent = list(ex.map(lambda s: driver.clients[s].sync_tied(driver.job_id, s, 0, 60.0), (0, 2)))
            after = [grad(0, "transformer.wte.weight"), grad(2, "lm_head.weight")]
            expected = before[0].clone()
            expected += before[1]
            assert torch.equal(after[0], expected) and torch.equal(after[1], expected)
            # Each holder sent its whole gradient to the other (plus framing), nothing else.
            size = before[0].numel() * 4
            assert all(size <= r.sent_bytes < size + 4096 for r in sent), [r.sent_bytes for r in sent]
            # Once per step: a second exchange would add the peer's gradient again.
            with pytest.raises(RemoteError, match="already synced"):
                driver.clients[0].sync_tied(driver.job_id, 0, 0, 60.0)
            # A stage that holds no tied parameter has nothing to exchange.
            assert driver.clients[1].sync_tied(driver.job_id, 1, 0, 60.0).sent_bytes == 0
            # A holder whose peer never answers is freed by an abort, with the reason.
            driver.forward_backward(1, (bx,), by)
            with ThreadPoolExecutor(1) as ex:
                waiting = ex.submit(driver.clients[0].sync_tied, driver.job_id, 0, 1, 60.0)
                time.sleep(0.5)
                driver.abort("stage 2 is gone")
                with pytest.raises(
                    RemoteError, match="aborted while waiting for tied gradients from stage 2: stage 2 is gone"
                ):
                    waiting.result(timeout=30)
        finally:
            driver.close()
    finally:
        pool.close()


def test_a_step_the_stages_finish_themselves_matches_the_driver_calls(cluster: LocalCluster) -> None:
    """``train_step`` has each stage exchange its tied gradients and apply on its own
    (RunStep's ``finish``): the weights after two steps are bit-identical to those of the
    separate SyncTied and ApplyStep calls, a late call for the finished step is refused, and
    a snapshot it asks for is taken after the update."""
    dataset = build_job_dataset(JOB)
    pool = ChannelPool()
    drivers = [three_stage_driver(f"finish-{how}", cluster, pool) for how in ("calls", "finish")]
    model = drivers[0].model
    calls, finish = drivers
    try:
        for d in drivers:
            d.load()
        for step in range(2):
            bx, by = job_batch(JOB, dataset, step)
            a = calls.forward_backward(step, (bx,), by)
            calls.sync_tied_gradients(step)
            calls.apply(step)
            snapshot = SnapshotRequest() if step == 1 else None
            b = finish.train_step(step, (bx,), by, snapshot=snapshot)
            assert a.loss == b.loss
        expected, got = calls.state_dict(), finish.state_dict()
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected), "weights differ"
        assert not torch.equal(got["lm_head.weight"], model.state_dict()["lm_head.weight"])  # it trained
        with pytest.raises(RemoteError, match="already applied step 1"):
            finish.clients[0].sync_tied(finish.job_id, 0, 1, 60.0)
        with pytest.raises(RemoteError, match="already applied step 1"):
            finish.clients[1].apply_step(finish.job_id, 1, 1)
        deadline = time.monotonic() + 30
        labels: list[int] = []
        while time.monotonic() < deadline and len(labels) < 3:
            labels = [s.step for i in range(3) for s in finish.clients[i].list_snapshots(finish.job_id)]
            time.sleep(0.05)
        assert labels == [2, 2, 2]  # each stage's state after step 1, taken by the stage itself
    finally:
        for d in drivers:
            d.close()
        pool.close()
