"""Planning's measurements on a real executor: the node profile, the calibration that
times the whole model as the executor runs it, and the costs the planner then uses.

The calibration's ``compute_factor`` is the executor's measured compute over the node
profile's sum; planning scales every node by it, so a one-stage plan on the calibrated
worker is predicted from what that worker actually did.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from executor.client import ChannelPool
from fusion.config import JobSpec
from fusion.coordinator.planning import (
    Endpoint,
    ExecutorOverhead,
    ModelProfile,
    calibrate_executor,
    costed_dag,
    profile_model,
)
from fusion.errors import FusionError
from fusion.graph.export import capture
from fusion.launch.executors import LocalCluster
from fusion.training import build_job_dataset, build_job_model, example_micro_batch

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 8, "seq_len": 16},
        "train": {"steps": 1, "micro_batches": 4, "optimizer": "adamw", "lr": 1e-3},
    }
)


@dataclass
class Setup:
    """The job's model captured, and a profile of it from one real executor."""

    model: Any
    dataset: Any
    captured: Any
    worker: Endpoint
    pool: ChannelPool
    profile: ModelProfile

    def calibrate(self, **kwargs: Any) -> ExecutorOverhead:
        return calibrate_executor(
            JOB, self.model, self.captured, self.dataset, self.worker, self.pool, self.profile, **kwargs
        )


@pytest.fixture
def setup(cluster: LocalCluster) -> Iterator[Setup]:
    model = build_job_model(JOB)
    dataset = build_job_dataset(JOB)
    example_x, _ = example_micro_batch(JOB, dataset)
    captured = capture(model, (example_x,))
    worker = Endpoint(name="w0", address=cluster.addresses[0], matmul_flops=1e11)
    pool = ChannelPool()
    try:
        yield Setup(model, dataset, captured, worker, pool, profile_model(JOB, captured.dag, worker, pool, repeats=3))
    finally:
        pool.close()


def test_calibration_measures_the_executors_compute(setup: Setup) -> None:
    calibrated = setup.calibrate(min_time_s=0.3)
    profile, captured = setup.profile, setup.captured
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


def test_calibration_computes_for_min_time_s_with_both_counts_in_turn(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """Five steps fall inside one speed phase of a shared machine; the calibration goes on
    until the M-micro-batch steps have computed ``min_time_s``, the 1-micro-batch steps
    taking turns with them."""
    with caplog.at_level(logging.INFO, logger="fusion.coordinator.planning"):
        t0 = time.monotonic()
        setup.calibrate(steps=2, min_time_s=1.0)
        elapsed_s = time.monotonic() - t0
    with pytest.raises(FusionError, match="steps >= 1"):
        setup.calibrate(steps=0)
    assert elapsed_s >= 1.0
    found = re.search(r"over (\d+) steps of each micro-batch count \[1, 4\]", caplog.text)
    assert found, caplog.text
    # A step of 4 micro-batches of this tiny model computes in milliseconds: 1 s takes many.
    assert int(found.group(1)) > 10, found.group(0)
