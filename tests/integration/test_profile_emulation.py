"""A worker that emulates a slower device by the profile (``--emulation profile``,
:class:`testbeds.worker.EmulatedDevice`) sleeps ``factor - 1`` times each stage's profiled
seconds, not times its wall time, and refuses a stage that has none.

Real executor processes (:mod:`tests.support.hooked_executor`, which hands the hook a table
of stage seconds where ``testbeds.worker`` asks the coordinator's ``GetProfile``); a tiny
GPT-2 whose real compute is a few milliseconds, so the profiled seconds given here (tens of
milliseconds) decide what the stages report.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from executor.local import LocalCluster, train_distributed
from fusion.config import JobSpec
from fusion.errors import FusionError
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


def _cluster(stage_seconds: dict[int, tuple[float, float]]) -> LocalCluster:
    return LocalCluster(
        2,
        torch_threads=1,
        module="tests.support.hooked_executor",
        extra_args=[
            *("--emulate-slowdown", str(FACTOR), "--emulation", "profile"),
            *("--stage-seconds", json.dumps(stage_seconds)),
        ],
    )


@pytest.fixture(scope="module")
def workers() -> Iterator[LocalCluster]:
    with _cluster(PROFILED_S) as c:
        yield c


def test_stages_stretch_by_their_profiled_seconds_and_train_the_same(workers: LocalCluster) -> None:
    result = train_distributed(JOB, workers.addresses)
    m = JOB.train.micro_batches
    for stats in result.stats:
        for stage, (fwd, bwd) in PROFILED_S.items():
            slept = (FACTOR - 1.0) * m * (fwd + bwd)
            # what a stage reports is its computation plus the sleep: the sleep is the profile's
            assert slept <= stats.compute_s[stage] < slept + 0.5, (stage, stats.compute_s)
    reference = train_reference(JOB)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5)  # emulation changes no number


def test_a_stage_without_profiled_seconds_is_refused_with_the_reason() -> None:
    with _cluster({0: PROFILED_S[0]}) as c:  # none for stage 1
        with pytest.raises(FusionError, match=r"--emulation profile.*no profiled seconds"):
            train_distributed(JOB, c.addresses, steps=1)
        train_distributed(JOB, c.addresses[:1], steps=1)  # still serving (one stage: stage 0's seconds)
