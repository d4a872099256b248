"""Topologies for the simulator: shipped files, generated ``paper-N`` ones shaped like the
FusionLLM paper's testbed, and a topology as a one-host testbed runs it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fusion.errors import PlanError
from scheduler.topology import GIB, Topology, WorkerSpec

TOPOLOGY_DIR = Path(__file__).resolve().parents[1] / "topologies"
MBPS = 1e6 / 8  # bytes/s in one megabit/s


def paper_topology(num_hosts: int, *, seed: int = 0) -> Topology:
    """A topology of ``num_hosts`` (a multiple of 8) shaped like ``paper-48.toml``.

    Clusters of 8 hosts cycle through the six kinds of ``paper-48.toml`` (A100 and V100 on
    10 Gbps, RTX 3090 and 2080 Ti on 1 Gbps, T4 and GTX 1080 Ti on 100 Mbps inside); the
    link between two clusters is drawn from 8 Mbps, 50 Mbps, 100 Mbps and 1 Gbps (latency
    10–150 ms), symmetric, seeded.
    """
    if num_hosts < 8 or num_hosts % 8:
        raise PlanError(f"paper topologies come in clusters of 8 hosts; {num_hosts} is not a multiple of 8")
    kinds = (  # (label, flops, memory GiB, intra Mbps, intra latency ms)
        ("a100", 1.95e13, 40, 10000, 0.1),
        ("v100", 1.4e13, 16, 10000, 0.1),
        ("rtx3090", 3.5e13, 24, 1000, 0.5),
        ("rtx2080ti", 1.34e13, 11, 1000, 0.5),
        ("t4", 8.1e12, 16, 100, 1.0),
        ("gtx1080ti", 1.13e13, 11, 100, 1.0),
    )
    rng = np.random.default_rng(seed)
    num_clusters = num_hosts // 8
    cluster_of = np.repeat(np.arange(num_clusters), 8)
    kind_of = np.arange(num_clusters) % len(kinds)
    inter = rng.choice([8.0, 50.0, 100.0, 1000.0], (num_clusters, num_clusters))
    inter = np.minimum(inter, inter.T)
    inter_lat = rng.uniform(10.0, 150.0, (num_clusters, num_clusters))
    inter_lat = np.maximum(inter_lat, inter_lat.T)
    intra = np.array([kinds[k][3] for k in kind_of], dtype=np.float64)
    intra_lat = np.array([kinds[k][4] for k in kind_of], dtype=np.float64)
    same = cluster_of[:, None] == cluster_of[None, :]
    bandwidth = np.where(same, intra[cluster_of][:, None], inter[cluster_of][:, cluster_of]) * MBPS
    latency = np.where(same, intra_lat[cluster_of][:, None], inter_lat[cluster_of][:, cluster_of]) / 1e3
    workers = [
        WorkerSpec(
            name=f"{kinds[kind_of[c]][0]}-{c}-{i % 8}",
            cluster=f"c{c}-{kinds[kind_of[c]][0]}",
            flops=kinds[kind_of[c]][1],
            memory_bytes=kinds[kind_of[c]][2] * GIB,
        )
        for i, c in enumerate(cluster_of)
    ]
    return Topology.from_measurements(workers, latency, bandwidth)


def load_topology(name: str) -> Topology:
    """A topology file path, a shipped topology's name, or ``paper-N`` (generated)."""
    path = Path(name)
    if path.exists():
        return Topology.load(path)
    shipped = TOPOLOGY_DIR / f"{name}.toml"
    if shipped.exists():
        return Topology.load(shipped)
    if name.startswith("paper-") and name[6:].isdigit():
        return paper_topology(int(name[6:]))
    raise PlanError(f"no topology {name!r}: give a TOML path, a name in {TOPOLOGY_DIR} or paper-N (N a multiple of 8)")


#: The machine every host of a one-host testbed computes on.
TESTBED_MACHINE = "testbed-host/cpu"


#: TCP payload per full Ethernet frame (1448 of 1514 bytes with timestamps): ``htb`` counts
#: frames, so a shaped link carries this share of its rate as payload (measured: 95.5-95.6 %).
TCP_PAYLOAD_SHARE = 1448 / 1514


def emulated_slowdowns(topology: Topology, *, speeds: bool = False) -> dict[str, float]:
    """Per host a one-machine testbed runs slower, by how many times
    (:class:`testbeds.emulation.Slowdown`): each host's ``slowdown`` (the topology file's
    testbed emulation factor); with ``speeds`` (``--emulate-speeds``), how many times
    slower than the topology's fastest host it is by ``flops / slowdown``, so that the
    hosts keep the topology's device speed ratios though they share one CPU."""
    if not speeds:
        return {w.name: w.slowdown for w in topology.workers if w.slowdown > 1.0}
    fastest = max(w.effective_flops for w in topology.workers)
    return {w.name: round(fastest / w.effective_flops, 3) for w in topology.workers if w.effective_flops < fastest}


def slowdowns_label(slowdowns: Mapping[str, float]) -> str:
    """``"b-1 3.18x, b-2 3.18x"``: the emulated hosts as tables and logs name them."""
    return ", ".join(f"{h} {f:.3g}x" for h, f in slowdowns.items())


#: A bench result's ``sends`` when fusion's and uniform's stages paced their sends at the
#: links' bandwidth (:mod:`executor.sender`); a result without it was recorded when each
#: stage sent one transfer at a time, each until its answer, and is replayed so.
PACED_SENDS = "paced"


def testbed_topology(
    topology: Topology,
    reference_flops: float | None,
    *,
    latency: bool = True,
    payload_share: float = 1.0,
    emulated: Mapping[str, float] | None = None,
    compute_factors: Mapping[str, float] | None = None,
    paced_sends: bool = True,
) -> Topology:
    """Every host at this machine's speed and on this machine (the workers share its CPU, as
    their coordinator sees from the boot id they report), as one-host testbeds run them;
    a host in ``emulated`` (:func:`emulated_slowdowns`, when the run emulated speeds) that
    many times slower. ``reference_flops=None`` keeps the hosts' speeds and machines,
    ``latency=False`` zeroes every latency, and every link carries ``payload_share`` of its
    rate (:data:`TCP_PAYLOAD_SHARE` on the netns backend, whose ``htb`` counts frames; 1 on
    the proxy backend, which paces payload). ``compute_factors``: hosts that computed that
    many times slower than ``reference_flops`` (a run's measured compute over the profile's).
    ``paced_sends``: :attr:`Topology.paced_sends`."""
    workers = topology.workers
    emulated = emulated or {}
    factors = compute_factors or {}
    if reference_flops:
        workers = tuple(
            dataclasses.replace(
                w,
                flops=reference_flops / factors.get(w.name, 1.0),
                slowdown=emulated.get(w.name, 1.0),
                machine=TESTBED_MACHINE,
            )
            for w in workers
        )
    lat = topology.latency_s if latency else tuple(tuple(0.0 for _ in row) for row in topology.latency_s)
    bw = tuple(tuple(b * payload_share for b in row) for row in topology.bandwidth_bytes_per_s)
    return Topology(workers=workers, bandwidth_bytes_per_s=bw, latency_s=lat, paced_sends=paced_sends)


def shared_cores_factor(workers: Sequence[WorkerSpec], cores: int | None) -> float:
    """How many times longer each rank's compute takes when the ranks on ``workers`` share
    ``cores`` (``None``: each has its own device). A rank emulating a slower device
    (``slowdown`` k, :mod:`testbeds.emulation`) sleeps ``(k - 1) / k`` of its compute, so it
    occupies ``1 / k`` of a core."""
    if not cores:
        return 1.0
    return max(1.0, sum(1.0 / w.slowdown for w in workers) / cores)
