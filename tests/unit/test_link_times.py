"""Measured link times: the curve, the topology that prices from it, and the loopback timer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fusion.config import JobSpec
from fusion.errors import ConfigError
from scheduler.topology import Topology, WorkerSpec
from testbeds.net import measure
from testbeds.net.link_times import link_classes
from testbeds.sim.baselines import simulate_pipelining
from testbeds.sim.costs import JobCosts, job_costs
from testbeds.sim.measured_links import LinkCurve, MeasuredTopology, with_link_times
from testbeds.sim.validation import link_times_beside
from tests.conftest import free_port

MBPS = 1e6 / 8
GPT2_TINY = """
name = "links-gpt2-tiny"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 8
seq_len = 32
[train]
micro_batches = 4
"""


@pytest.fixture(scope="module")
def tiny_pipeline_job() -> JobCosts:
    """GPT-2 tiny costed from FLOPs (captured on the meta device: fast, deterministic)."""
    return job_costs(JobSpec.from_toml(GPT2_TINY), costs="flops")


def two_clusters() -> Topology:
    """x-1, x-2 in cluster x; y-1 in cluster y; 100 Mbps, 20 ms across, 1 Gbps, 0.5 ms inside."""
    workers = [WorkerSpec(name=n, cluster=n[0], flops=1e12) for n in ("x-1", "x-2", "y-1")]
    lat = [[0.0, 5e-4, 0.02], [5e-4, 0.0, 0.02], [0.02, 0.02, 0.0]]
    bw = [[1000 * MBPS, 1000 * MBPS, 100 * MBPS], [1000 * MBPS, 1000 * MBPS, 100 * MBPS], [100 * MBPS] * 3]
    return Topology.from_measurements(workers, lat, bw)


def doc(seconds_across: list[float]) -> dict:
    return {
        "backend": "netns",
        "latency_mode": "tun",
        "topology": "t",
        "sizes": [1024, 65536, 262144],
        "links": {"x->y": {"hosts": ["x-1", "y-1"], "seconds": seconds_across}},
    }


def test_curve_interpolates_and_extrapolates_at_the_link_rate() -> None:
    c = LinkCurve((1000, 3000), (0.04, 0.06))
    assert c.answered_s(10, 1e6) == 0.04  # below the smallest size: its time
    assert c.answered_s(2000, 1e6) == pytest.approx(0.05)
    assert c.answered_s(5000, 1e6) == pytest.approx(0.06 + 2000 / 1e6)


@pytest.mark.parametrize(
    "sizes,seconds", [((1000,), (0.1,)), ((2000, 1000), (0.1, 0.2)), ((1000, 2000), (0.1, -1.0)), ((1, 2), (0.1,))]
)
def test_curve_refuses_malformed_measurements(sizes: tuple, seconds: tuple) -> None:
    with pytest.raises(ConfigError):
        LinkCurve(sizes, seconds)


def test_measured_topology_prices_the_clusters_it_covers() -> None:
    base = two_clusters()
    t = with_link_times(base, doc([0.041, 0.061, 0.062]))
    assert isinstance(t, MeasuredTopology)
    # x -> y from the curve, less the answer's way back (20 ms): 64 KB arrives after 41 ms.
    assert t.transfer_s(0, 2, 65536) == pytest.approx(0.061 - 0.02)
    assert t.transfer_s(1, 2, 65536) == pytest.approx(0.041)  # every host of the cluster
    # Not measured (y -> x, inside x): the configured link, as the plain topology prices it.
    assert t.transfer_s(2, 0, 65536) == base.transfer_s(2, 0, 65536)
    assert t.transfer_s(0, 1, 65536) == base.transfer_s(0, 1, 65536)
    # Never faster than the latency, however small the answer time.
    assert with_link_times(base, doc([0.021, 0.03, 0.05])).transfer_s(0, 2, 10) == pytest.approx(0.02)


def test_the_curves_survive_placing_the_driver() -> None:
    t = with_link_times(two_clusters(), doc([0.041, 0.061, 0.062])).with_driver_at(0)
    assert isinstance(t, MeasuredTopology) and t.transfer_s(0, 2, 65536) == pytest.approx(0.041)
    assert dataclasses.replace(t, driver_links=None).curves == t.curves


def test_link_classes_one_pair_per_ordered_cluster_pair() -> None:
    assert link_classes(two_clusters()) == {
        ("x", "x"): ("x-1", "x-2"),
        ("x", "y"): ("x-1", "y-1"),
        ("y", "x"): ("y-1", "x-1"),
    }


def test_pipelining_pays_the_measured_times(tiny_pipeline_job: JobCosts) -> None:
    """The GPipe model takes its transfers from the topology, so a slower measured link
    slows the predicted step by about that much per transfer."""
    base = two_clusters()  # GPT-2 tiny's two blocks go to x-1 and x-2
    slow = with_link_times(
        base, {**doc([0.2, 0.2, 0.2]), "links": {"x->x": {"hosts": ["x-1", "x-2"], "seconds": [0.2, 0.2, 0.2]}}}
    )
    plain = simulate_pipelining(tiny_pipeline_job, base)
    measured = simulate_pipelining(tiny_pipeline_job, slow)
    assert (
        measured.step_s > plain.step_s + 2 * tiny_pipeline_job.spec.train.micro_batches * 0.19
    )  # each way, each micro-batch


def test_link_times_beside_only_for_the_same_testbed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    run = {"topology": "t", "backend": "netns", "latency_mode": "tun"}
    assert link_times_beside(run, tmp_path) is None
    (tmp_path / "links-t.json").write_text(json.dumps(doc([0.04, 0.06, 0.07])))
    assert link_times_beside(run, tmp_path)["links"]
    assert link_times_beside({**run, "latency_mode": "userspace"}, tmp_path) is None
    assert link_times_beside({**run, "backend": "proxy"}, tmp_path) is None


def test_transfers_times_each_size_until_the_answer() -> None:
    """The real timer over loopback: an answer server process and the client."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "testbeds.net.measure", "answer", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().startswith("ready")
        got = measure.transfers(f"127.0.0.1:{port}", [1024, 4 << 20], repeats=2, idle_s=0.01, warm=1)
        burst = measure.transfers(f"127.0.0.1:{port}", [1024], repeats=2, idle_s=0.01, warm=1, burst=2 << 20)
    finally:
        server.kill()
        server.wait(timeout=10)
    assert got["sizes"] == [1024, 4 << 20]
    small, large = got["seconds"]
    assert 0 < small < large < 5
    assert burst["sizes"] == [1024] and 0 < burst["seconds"][0] < large
