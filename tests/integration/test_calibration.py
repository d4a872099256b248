"""Planning's measurements on a real executor: the node profile, the calibration that
times the whole model as the executor runs it, and the costs the planner then uses.

The calibration's ``compute_factor`` is the executor's measured compute over the node
profile's sum; planning scales every node by it, so a one-stage plan on the calibrated
worker is predicted from what that worker actually did.
"""

from __future__ import annotations

import math

import pytest

from executor.client import ChannelPool
from executor.local import LocalCluster
from fusion.config import JobSpec
from fusion.coordinator.planning import (
    Endpoint,
    calibrate_executor,
    costed_dag,
    profile_model,
)
from fusion.graph.export import capture
from fusion.training import build_job_dataset, build_job_model, example_micro_batch

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 8, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 4, "optimizer": "adamw", "lr": 1e-3},
    }
)


def test_calibration_measures_the_executors_compute(cluster: LocalCluster) -> None:
    model = build_job_model(JOB)
    dataset = build_job_dataset(JOB)
    example_x, _ = example_micro_batch(JOB, dataset)
    captured = capture(model, (example_x,))
    worker = Endpoint(name="w0", address=cluster.addresses[0], matmul_flops=1e11)
    pool = ChannelPool()
    try:
        profile = profile_model(JOB, captured.dag, worker, pool, repeats=3)
        calibrated = calibrate_executor(JOB, model, captured, dataset, worker, pool, profile)
    finally:
        pool.close()
    assert calibrated.step_s >= 0 and calibrated.micro_batch_s >= 0
    # The executor runs the same operators the profile timed: on one machine the two agree
    # to within a small factor (not 0, not 10x; 1.6-2.8 for this tiny model here, with and
    # without two busy processes beside it).
    assert 0.1 < calibrated.compute_factor < 10.0, calibrated
    profile.compute_factor = calibrated.compute_factor
    scaled = costed_dag(captured.dag, profile)
    raw = sum(v["fwd_time_s"] + v["bwd_time_s"] for k, v in profile.nodes.items() if not k.startswith("__"))
    total = sum((n.fwd_time_s or 0.0) + (n.bwd_time_s or 0.0) for n in scaled.compute_nodes())
    assert math.isclose(total, raw * calibrated.compute_factor, rel_tol=1e-6)
    profile.compute_factor = None  # an uncalibrated profile plans on the raw node times
    assert sum((n.fwd_time_s or 0.0) for n in costed_dag(captured.dag, profile).compute_nodes()) == pytest.approx(
        sum(v["fwd_time_s"] for k, v in profile.nodes.items() if not k.startswith("__"))
    )
