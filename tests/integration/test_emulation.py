"""Executors that emulate a slower device (the testbeds' compute hook,
:class:`testbeds.worker.EmulatedDevice`): the same numbers as single-process PyTorch, and
compute the executor reports stretched by the factor.

The stretch is a sleep of ``factor - 1`` times each computation, so a 4x emulation must
report far more compute than the same model on an unslowed executor of the shared cluster;
the bound (2x) leaves room for this machine's noise in the computations themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from executor.client import ChannelPool
from fusion.config import JobSpec
from fusion.coordinator.planning import Endpoint, calibrate_executor, profile_model
from fusion.graph.export import capture
from fusion.launch.executors import LocalCluster
from fusion.training import build_job_dataset, build_job_model, example_micro_batch
from tests.support.parity import assert_parity

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 8, "seq_len": 16},
        "train": {"steps": 2, "micro_batches": 2, "optimizer": "adamw", "lr": 1e-3},
    }
)
FACTOR = 4.0
#: A bare executor with the test hooks (:mod:`tests.support.hooked_executor`).
HOOKED = "tests.support.hooked_executor"


@pytest.fixture(scope="module")
def slowed() -> Iterator[LocalCluster]:
    with LocalCluster(2, torch_threads=1, module=HOOKED, extra_args=["--emulate-slowdown", str(FACTOR)]) as c:
        yield c


def test_a_slowed_executor_trains_exactly_as_pytorch(slowed: LocalCluster) -> None:
    assert_parity(JOB, slowed.addresses, steps=2)


@pytest.mark.quiet
def test_a_slowed_executor_reports_stretched_compute(slowed: LocalCluster, cluster: LocalCluster) -> None:
    model = build_job_model(JOB)
    dataset = build_job_dataset(JOB)
    example_x, _ = example_micro_batch(JOB, dataset)
    captured = capture(model, (example_x,))
    pool = ChannelPool()
    try:
        factors = []
        for address in (cluster.addresses[0], slowed.addresses[0]):
            worker = Endpoint(name="w", address=address, matmul_flops=1e11)
            profile = profile_model(JOB, captured.dag, worker, pool, repeats=3)
            factors.append(
                calibrate_executor(JOB, model, captured, dataset, worker, pool, profile, min_time_s=0.3).compute_factor
            )
    finally:
        pool.close()
    plain, slow = factors
    assert slow > 2.0 * plain, factors


def test_a_bad_factor_stops_the_executor_with_a_clear_error() -> None:
    with pytest.raises(Exception, match="slowdown must be a finite number >= 1"):
        with LocalCluster(
            1, torch_threads=1, start_timeout_s=60, module=HOOKED, extra_args=["--emulate-slowdown", "0.5"]
        ):
            pass
