"""The codec trial over real workers: the driver runs the trial's dense steps with every cut
dense (no codec on either link, the bytes sent are the dense bytes, the consumer's
error-feedback residuals handed over), its compressed steps as planned, and after a verdict
of dense every step dense; the step that decides says why."""

from __future__ import annotations

import pytest

from executor.client import ChannelPool, ExecutorClient
from executor.codec_trial import CodecTrial
from executor.compression import CutSetting
from executor.driver import PipelineDriver
from fusion.config import JobSpec
from fusion.graph.export import capture
from fusion.graph.split import split_stages
from fusion.launch.executors import LocalCluster
from fusion.training import build_job_dataset, build_job_model, example_micro_batch, job_batch
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb
from scheduler.baselines import uniform_assignment

pytestmark = pytest.mark.timeout(300)

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 8, "seq_len": 16},
        "train": {"steps": 7, "micro_batches": 2, "optimizer": "adamw", "lr": 3e-3},
    }
)
CUT = (0, 1)


def test_dense_trial_steps_travel_dense_and_a_dense_verdict_holds(cluster: LocalCluster) -> None:
    model = build_job_model(JOB)
    dataset = build_job_dataset(JOB)
    ex, ey = example_micro_batch(JOB, dataset)
    captured = capture(model, (ex,))
    stages = split_stages(captured.dag, uniform_assignment(captured.dag, 2))
    pool = ChannelPool()
    # A convergence cost no step time can pay for: the verdict must be dense.
    trial = CodecTrial(convergence_cost=100.0, skip_steps=1, pairs=2)
    driver = PipelineDriver(
        job_id="codec-trial",
        job=JOB,
        model=model,
        captured=captured,
        stages=stages,
        addresses=cluster.addresses[:2],
        example_target=ey,
        pool=pool,
        cut_settings={CUT: CutSetting(codec=pb.CODEC_TOPK, keep_ratio=0.1, gradient_codec=pb.CODEC_QUANT)},
        codec_trial=trial,
    )
    consumer = ExecutorClient(cluster.addresses[1], pool)
    try:
        driver.load()
        stats, residual_sums = [], []
        for step in range(JOB.train.steps):
            x, y = job_batch(JOB, dataset, step)
            stats.append(driver.train_step(step, (x,), y))
            residuals = consumer.get_state("codec-trial", 1, epb.STATE_KIND_RESIDUALS)
            residual_sums.append(sum(float(r.abs().sum()) for r in residuals.values()))
    finally:
        driver.close()
        pool.close()
    assert [s.dense_trial for s in stats] == [False, True, False, True, False, True, True]
    for s in stats:
        back = (CUT[1], CUT[0])
        if s.dense_trial:
            assert s.link_codecs == {}, s.step
            assert s.sent_bytes[CUT] == s.dense_bytes[CUT] and s.sent_bytes[back] == s.dense_bytes[back], s.step
        else:
            assert s.link_codecs[CUT]["codec"] == "topk" and s.link_codecs[back]["codec"] == "quant", s.step
            assert s.sent_bytes[CUT] < s.dense_bytes[CUT] / 2 and s.sent_bytes[back] < s.dense_bytes[back], s.step
    for s, owed in zip(stats, residual_sums, strict=True):
        assert (owed == 0) == s.dense_trial, (s.step, owed)  # a dense step hands the residual over
    verdicts = [s.trial_verdict for s in stats]
    assert verdicts[:4] == [None] * 4 and verdicts[5:] == [None, None], verdicts
    assert verdicts[4] is not None and verdicts[4].endswith("running every cut dense"), verdicts[4]
    assert trial.verdict == "dense"
