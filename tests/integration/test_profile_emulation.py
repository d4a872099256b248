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
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.hooks import StageInfo
from fusion.config import JobSpec, load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.errors import FusionError, RemoteError
from fusion.launch import Fleet
from fusion.launch.distributed import train_distributed
from fusion.launch.executors import LocalCluster
from fusion.training import train_reference
from testbeds.worker import coordinator_stage_seconds, stage_seconds

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


def test_the_coordinator_serves_the_profile_a_job_was_planned_with(tmp_path: Path) -> None:
    """``GetProfile``: what ``testbeds.worker --emulation profile`` asks when a stage loads."""
    token = "profile-token"
    job_path = tmp_path / "job.toml"
    job_path.write_text(
        textwrap.dedent(f"""
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = 2
        micro_batches = 2
        optimizer = "sgd"
        lr = 0.1
        [cluster]
        min_workers = 2
        spares = 0
        [plan]
        strategy = "uniform"
        [output]
        dir = "{tmp_path / "out"}"
    """)
    )
    with Fleet(tmp_path / "logs") as fleet:
        address = fleet.start_coordinator(
            token=token, state_dir=tmp_path / "state", extra_args=["--calibrate-seconds", "0.2"]
        )
        for name in ("w0", "w1"):
            fleet.start_worker(name, token=token)
        with CoordinatorClient(address, token) as client:
            job_id = client.submit(load_job(job_path))
            deadline = time.monotonic() + 240
            while (s := client.status(job_id))["state"] not in ("succeeded", "failed", "cancelled"):
                assert time.monotonic() < deadline, s
                time.sleep(0.2)
            assert s["state"] == "succeeded", s
            profile = client.get_profile(job_id)
            with pytest.raises(RemoteError) as info:
                client.get_profile("no-such-job")
            assert info.value.code == "NOT_FOUND"
        with pytest.raises(RemoteError) as info, CoordinatorClient(address, "wrong-token") as stranger:
            stranger.get_profile(job_id)
        assert info.value.code == "UNAUTHENTICATED"
        plan = json.loads((Path(s["output_dir"]) / "plan.json").read_text())
        nodes = [tuple(stage["nodes"]) for stage in plan["stages"]]
        lookup = coordinator_stage_seconds(address, token)  # what the testbeds worker's hook asks
        looked_up = [lookup(StageInfo(job_id=job_id, stage_idx=i, nodes=n)) for i, n in enumerate(nodes)]
    assert profile.calibrated and profile.compute_factor > 0 and profile.matmul_flops > 0
    assert len(nodes) == 2
    factor = profile.compute_factor
    costed = {n.name: (n.forward_s * factor, n.backward_s * factor) for n in profile.nodes}
    for stage_nodes, got in zip(nodes, looked_up, strict=True):
        want = tuple(sum(costed[n][k] for n in stage_nodes if n in costed) for k in (0, 1))
        assert want[0] > 0 and want[1] > 0
        assert got == pytest.approx(want) == stage_seconds(profile, stage_nodes)
