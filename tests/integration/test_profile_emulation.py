"""A worker that emulates a slower device by the profile (``--emulation profile``) sleeps
``factor - 1`` times each stage's profiled seconds, not times its wall time, and refuses a
stage that comes without them.

Real executor processes; a tiny GPT-2 whose real compute is a few milliseconds, so the
profiled seconds given here (tens of milliseconds) decide what the stages report.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fusion.config import JobSpec
from fusion.errors import FusionError
from fusion.launch.distributed import train_distributed
from fusion.launch.executors import LocalCluster
from fusion.training import train_reference

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 4, "seq_len": 16},
        "train": {"steps": 2, "micro_batches": 2, "optimizer": "sgd", "lr": 0.1},
    }
)
FACTOR = 3.0
PROFILED_S = {0: (0.02, 0.04), 1: (0.03, 0.05)}


@pytest.fixture(scope="module")
def workers() -> Iterator[LocalCluster]:
    with LocalCluster(
        2, torch_threads=1, extra_args=["--emulate-slowdown", str(FACTOR), "--emulation", "profile"]
    ) as c:
        yield c


def test_stages_stretch_by_their_profiled_seconds_and_train_the_same(workers: LocalCluster) -> None:
    result = train_distributed(JOB, workers.addresses, profiled_s=PROFILED_S)
    m = JOB.train.micro_batches
    for stats in result.stats:
        for stage, (fwd, bwd) in PROFILED_S.items():
            slept = (FACTOR - 1.0) * m * (fwd + bwd)
            # what a stage reports is its computation plus the sleep: the sleep is the profile's
            assert slept <= stats.compute_s[stage] < slept + 0.5, (stage, stats.compute_s)
    reference = train_reference(JOB)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5)  # emulation changes no number


def test_a_stage_without_profiled_seconds_is_refused_with_the_reason(workers: LocalCluster) -> None:
    with pytest.raises(FusionError, match=r"--emulation profile.*no profiled seconds"):
        train_distributed(JOB, workers.addresses, steps=1)
    train_distributed(JOB, workers.addresses, steps=1, profiled_s=PROFILED_S)  # still serving


def test_malformed_profiled_seconds_are_refused_by_name(workers: LocalCluster) -> None:
    with pytest.raises(FusionError, match="profiled seconds must be finite"):
        train_distributed(JOB, workers.addresses, steps=1, profiled_s={0: (float("nan"), 0.01), 1: (0.01, 0.01)})
    with pytest.raises(FusionError, match="profiled seconds must be finite"):
        train_distributed(JOB, workers.addresses, steps=1, profiled_s={0: (0.01, 0.01), 1: (-1.0, 0.01)})
