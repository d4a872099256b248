"""The bytes-free topology (:mod:`testbeds.free_bytes`): slow links made plentiful, every
latency and every host as it was."""

from __future__ import annotations

import math

import pytest

from fusion.errors import ConfigError
from testbeds.free_bytes import MBPS, floor_bandwidth, floor_label
from testbeds.net.testbed import resolve_topology


def test_slow_links_are_raised_and_latencies_kept() -> None:
    topology, _ = resolve_topology("two-sites-split")
    floored = floor_bandwidth(topology.with_driver_at(0), 10_000)
    slow = [(i, j) for i in range(len(topology)) for j in range(len(topology)) if i != j]
    assert min(topology.bandwidth_bytes_per_s[i][j] for i, j in slow) == pytest.approx(100 * MBPS)
    for i, j in slow:
        assert floored.bandwidth_bytes_per_s[i][j] == pytest.approx(10_000 * MBPS)
        assert floored.latency_s[i][j] == topology.latency_s[i][j]
    assert floored.workers == topology.workers
    assert all(bw >= 10_000 * MBPS for _, bw in floored.driver_links or ())
    assert math.isinf(floored.driver_links[0][1])  # the driver's own host stays free
    assert [rtt for rtt, _ in floored.driver_links] == [rtt for rtt, _ in topology.with_driver_at(0).driver_links]


def test_a_floor_under_a_link_leaves_it_alone() -> None:
    topology, _ = resolve_topology("two-sites-split")
    floored = floor_bandwidth(topology, 500)
    assert floored.bandwidth_bytes_per_s[0][1] == topology.bandwidth_bytes_per_s[0][1]  # 1 Gbps LAN
    assert max(floored.bandwidth_bytes_per_s[0][2:]) == pytest.approx(500 * MBPS)  # 100 Mbps -> 500
    assert "500 Mbps" in floor_label(500)


@pytest.mark.parametrize("mbps", [0, -1, math.inf, math.nan])
def test_a_floor_must_be_a_positive_number(mbps: float) -> None:
    topology, _ = resolve_topology("two-sites-split")
    with pytest.raises(ConfigError, match="bandwidth floor"):
        floor_bandwidth(topology, mbps)
