"""The driver's path in the estimator and the planner: feed and control over the
coordinator's link to each worker (``Topology.driver_links``).

Expected step times are derived by hand from the estimator's formula (its module
docstring): ``T = P + (M - 1) · B + t_step`` with the feed ``φ_s`` delaying a stage's first
forward and bounding the period (``RunStep`` and the feed leave together), plus
``0.5 · max r`` to hear that the stages are done.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from fusion.errors import PlanError
from scheduler.estimator import StepCosts, estimate
from scheduler.partition import opfence_placement
from scheduler.topology import Topology
from tests.unit.test_opfence import MBPS, chain_workload, make_topology

TOPOLOGY_DIR = Path(__file__).resolve().parents[2] / "testbeds" / "topologies"


def test_driver_at_a_host_uses_that_hosts_links() -> None:
    topo = Topology.load(TOPOLOGY_DIR / "three-continents.toml")
    with_driver = topo.with_driver_at(topo.index("us-1"))
    assert with_driver.driver_link(topo.index("us-1")) == (0.0, math.inf)
    # us -> asia: 150 ms each way, 8 Mbps.
    rtt, bw = with_driver.driver_link(topo.index("asia-1"))
    assert rtt == pytest.approx(0.3) and bw == pytest.approx(8 * MBPS)
    assert with_driver.nearest_to_driver() == topo.index("us-1")
    assert topo.nearest_to_driver() is None and topo.driver_link(0) == (0.0, math.inf)


def test_driver_links_survive_subset_and_json() -> None:
    topo = Topology.load(TOPOLOGY_DIR / "two-sites.toml").with_driver_at(0)
    back = Topology.from_json(topo.to_json())
    assert back.driver_links == topo.driver_links
    sub = topo.subset([2, 0])
    assert sub.driver_links == (topo.driver_links[2], topo.driver_links[0])
    assert Topology.from_json(topo.with_driver_links(None).to_json()).driver_links is None


@pytest.mark.parametrize(
    ("links", "match"),
    [
        ([(0.0, 1e6)], "has 1 entries"),
        ([(-1.0, 1e6), (0.0, 1e6)], "round trip must be >= 0"),
        ([(0.0, 0.0), (0.0, 1e6)], "bandwidth positive"),
        ([("x", 1e6), (0.0, 1e6)], "one \\(round_trip_s, bandwidth_bytes_per_s\\) pair"),
    ],
)
def test_bad_driver_links_are_refused(links: list, match: str) -> None:
    topo = make_topology(np.full((2, 2), 1e9))
    with pytest.raises(PlanError, match=match):
        topo.with_driver_links(links)


@pytest.mark.parametrize("paced", [True, False])
def test_one_stage_far_from_the_driver_pays_control_and_feed(paced: bool) -> None:
    m = 4
    target = 20_000
    wl = chain_workload([0.01, 0.02], input_bytes=[50_000, 0], step=StepCosts(target_bytes=target))
    rtt, bw = 0.1, 1e6
    topo = make_topology(np.full((2, 2), 1e9)).with_driver_links([(0.0, math.inf), (rtt, bw)])
    topo = dataclasses.replace(topo, paced_sends=paced)
    near = estimate(wl, [0, 0], [0], topo, micro_batches=m)
    far = estimate(wl, [0, 0], [1], topo, micro_batches=m)
    compute = 0.03 + 0.06  # forward + backward per micro-batch
    assert near.step_s == pytest.approx(m * compute)
    # One stage reads the inputs and computes the loss: two sends per micro-batch, leaving
    # with RunStep. Paced, they hold the link for their bytes and the first arrives half a
    # round trip after its bytes left; one at a time, each holds the link a round trip and
    # its bytes. The driver hears the end half a round trip after it.
    if paced:
        first, held = (50_000 + target) / bw + rtt / 2, (50_000 + target) / bw
    else:
        first = held = (rtt + 50_000 / bw) + (rtt + target / bw)
    assert far.bottleneck_s == pytest.approx(max(compute, held))
    assert far.step_s == pytest.approx(first + compute + (m - 1) * max(compute, held) + 0.5 * rtt)


def test_feed_only_delays_the_stages_that_read_from_the_driver() -> None:
    wl = chain_workload([0.05, 0.05], input_bytes=[1_000, 0], step=StepCosts(target_bytes=0))
    topo = make_topology(np.full((2, 2), 1e9)).with_driver_links([(0.0, math.inf), (0.02, math.inf)])
    est = estimate(wl, [0, 1], [0, 1], topo, micro_batches=1)
    # Stage 1 (the loss stage, a target send of 0 bytes) gets its target long before its
    # input arrives from stage 0; only hearing that it is done shows.
    base = estimate(wl, [0, 1], [0, 1], topo.with_driver_links(None), micro_batches=1)
    assert est.step_s == pytest.approx(base.step_s + 0.5 * 0.02)


def test_tied_sync_goes_between_the_holders() -> None:
    step = StepCosts(driver_round_trip_s=0.5)  # no call from the driver starts it
    tied = chain_workload([0.01, 0.01], param_bytes=[4_000_000] * 2, param_ids=[0, 0], step=step)
    untied = chain_workload([0.01, 0.01], param_bytes=[4_000_000] * 2, param_ids=[0, 1], step=step)
    topo = make_topology(np.full((2, 2), 1e9)).with_driver_links([(0.01, 1e8), (0.03, 5e7)])
    diff = (
        estimate(tied, [0, 1], [0, 1], topo, micro_batches=2).step_s
        - estimate(untied, [0, 1], [0, 1], topo, micro_batches=2).step_s
    )
    # The holders start the exchange themselves once their schedules are done, and the
    # gradients go between them, over their 1 GB/s link, not over the driver's.
    assert diff == pytest.approx(4_000_000 / 1e9)


@pytest.mark.parametrize("driver", ["us-1", "eu-2", "asia-1"])
def test_opfence_puts_a_small_model_next_to_the_driver(driver: str) -> None:
    """Equal workers, a model that fits on one: the plan goes where the driver is, not
    across a slow link from it (the placement the testbed measured as 17x slower)."""
    topo = Topology.load(TOPOLOGY_DIR / "three-continents.toml")
    equal = Topology(
        workers=tuple(type(w)(name=w.name, cluster=w.cluster, flops=1e12) for w in topo.workers),
        bandwidth_bytes_per_s=topo.bandwidth_bytes_per_s,
        latency_s=topo.latency_s,
    ).with_driver_at(topo.index(driver))
    wl = chain_workload(
        [0.002] * 8, input_bytes=[2_000] + [0] * 7, edge_bytes=[400_000] * 7, step=StepCosts(target_bytes=2_000)
    )
    placement, _ = opfence_placement(wl, equal, micro_batches=4, schedule="1f1b", time_budget_s=0.5)
    assert placement.workers[0] == equal.index(driver)
    assert all(equal.workers[w].cluster == equal.workers[equal.index(driver)].cluster for w in placement.workers)
