"""The bytes-free bound: how short a step could get if a codec sent almost nothing.

A codec changes one thing about a step: the bytes its cuts put on the wire (and the compute
it spends encoding them). However small it makes them, the step keeps its compute, the
links' latencies and the executor's own costs, so no codec can make a step shorter than the
same plan's step on the same links with their bandwidth made plentiful and their latency
kept. :func:`floor_bandwidth` builds that topology: every link at least ``mbps`` Mbps (the
driver's links too), each latency as it was, the hosts unchanged. A dense run on it
(``python -m testbeds.bench --bandwidth-floor 10000``, side by side with a dense run on the
real links) measures the bound; the ratio of the two steps is the least time, relative to
dense, that any compression can reach on that cell at the same convergence per step.
"""

from __future__ import annotations

from dataclasses import replace

from fusion.errors import ConfigError
from scheduler.topology import Topology

#: Bytes per second in one Mbps.
MBPS = 1e6 / 8


def floor_bandwidth(topology: Topology, mbps: float) -> Topology:
    """``topology`` with every link's bandwidth raised to at least ``mbps`` Mbps, latencies kept.

    Raises:
        ConfigError: ``mbps`` is not a positive, finite number.
    """
    if not 0 < mbps < float("inf"):
        raise ConfigError(f"a bandwidth floor must be a positive number of Mbps, got {mbps!r}")
    floor = mbps * MBPS
    bandwidth = [[max(bw, floor) for bw in row] for row in topology.bandwidth_bytes_per_s]
    driver = None
    if topology.driver_links is not None:
        driver = tuple((rtt, max(bw, floor)) for rtt, bw in topology.driver_links)
    return replace(topology, bandwidth_bytes_per_s=bandwidth, driver_links=driver)


def floor_label(mbps: float) -> str:
    """How a result on a floored topology is labelled."""
    return f"every link at least {mbps:g} Mbps, latencies kept"
