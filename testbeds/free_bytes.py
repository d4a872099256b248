"""The cell with its bytes made free: how much of a step the links' bandwidth costs.

A codec changes one thing about a step: the bytes its cuts put on the wire (and the compute
it spends encoding them). However small it makes them, the step keeps its compute, the
links' latencies and the executor's own costs. :func:`floor_bandwidth` builds the cell
where bytes cost (almost) nothing: every link at least ``mbps`` Mbps (the driver's links
too), each latency as it was, the hosts unchanged. A dense run there
(``python -m testbeds.bench --bandwidth-floor 10000``, beside a dense run on the real
links) shows how much of the real step the bandwidth accounts for. Where the two steps are
about equal, no codec can shorten the step much, and a target such as "time to loss at most
0.7x dense's" is out of reach by compression. It is an estimate, not a strict bound: the
planner sees the free links and may place the model otherwise (a plan that a codec on the
real links would not get, better or worse), and the machine drifts between the two runs.
"""

from __future__ import annotations

from dataclasses import replace

from fusion.errors import ConfigError
from scheduler.topology import Topology
from testbeds.sim.topologies import MBPS


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
