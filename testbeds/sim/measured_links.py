"""Links priced from their measured message times (:mod:`testbeds.net.link_times`).

The simulator prices a transfer as ``latency + bytes / bandwidth``. A single message after
a pause, on a connection that has only ever carried such messages (gloo's point-to-point
sends, which the pipelining baseline makes once per micro-batch), does not take that on
the emulated long links: it takes about half a round trip more. The cause is BBR, this
kernel's congestion control: it learns a connection's rate only from bursts that are not
limited by the application, so a connection that carries nothing but short messages keeps
pacing them at the rate its first bursts showed (docs/benchmarks.md, "Left open"). fusion's
data plane sends one burst of a few bandwidth-delay products on each new connection over a
long link (:mod:`executor.stream_client`) and does not pay it. So
:mod:`testbeds.sim.validation` prices the gloo baselines' transfers from these curves
(measured without that burst) and fusion's from the configured links;
:class:`MeasuredTopology` prices every transfer between two measured clusters from their
curve (linear between sizes; beyond the largest, at the link's rate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusion.errors import ConfigError
from scheduler.topology import Topology


@dataclass(frozen=True)
class LinkCurve:
    """Seconds from sending a message to the receiver's answer, by message size."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or len(self.sizes) != len(self.seconds) or list(self.sizes) != sorted(set(self.sizes)):
            raise ConfigError(
                f"a link curve needs two or more increasing sizes with one time each, got {self.sizes} / {self.seconds}"
            )
        if any(not 0 < s < 3600 for s in self.seconds):
            raise ConfigError(f"link curve times must be positive seconds, got {self.seconds}")

    def answered_s(self, size_bytes: float, bandwidth_bytes_per_s: float) -> float:
        """Interpolated time to the answer; past the largest size, the rest at ``bandwidth``."""
        if size_bytes >= self.sizes[-1]:
            return self.seconds[-1] + (size_bytes - self.sizes[-1]) / bandwidth_bytes_per_s
        return float(np.interp(size_bytes, self.sizes, self.seconds))  # below the smallest size: its time


@dataclass(frozen=True, kw_only=True)
class MeasuredTopology(Topology):
    """A topology whose transfers between measured clusters take what :class:`LinkCurve`
    says: the time to the answer less the answer's way back (its latency)."""

    curves: tuple[tuple[LinkCurve | None, ...], ...] = field(default=(), compare=False)
    """``[i][j]``: the curve of the link ``i -> j`` (``None``: priced as a plain topology)."""

    def transfer_s(self, i: int, j: int, size_bytes: float) -> float:
        plain = super().transfer_s(i, j, size_bytes)
        curve = self.curves[i][j] if self.curves else None
        if curve is None or i == j:
            return plain
        one_way = curve.answered_s(size_bytes, self.bandwidth_bytes_per_s[i][j]) - self.latency_s[j][i]
        return max(one_way, self.latency_s[i][j])


def with_link_times(topology: Topology, doc: Mapping[str, Any]) -> MeasuredTopology:
    """``topology`` (the testbed's, in the order of the measured file's topology) with the
    curves of a :func:`measure` document applied by cluster pair."""
    by_clusters = {
        tuple(key.split("->")): LinkCurve(tuple(int(s) for s in doc["sizes"]), tuple(float(t) for t in v["seconds"]))
        for key, v in doc["links"].items()
    }
    clusters = [w.cluster for w in topology.workers]
    curves = tuple(tuple(by_clusters.get((a, b)) for b in clusters) for a in clusters)
    return MeasuredTopology(
        workers=topology.workers,
        bandwidth_bytes_per_s=topology.bandwidth_bytes_per_s,
        latency_s=topology.latency_s,
        driver_links=topology.driver_links,
        curves=curves,
    )
