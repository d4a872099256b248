"""Time dilation: a one-machine testbed whose hosts compute in parallel as separate devices.

Every host of a testbed computes on this machine's few cores. A pipeline of ``k`` stages on
``k`` hosts should compute its stages at the same time, as ``k`` devices would; on two
cores, six stages that compute at once each get a third of a core, and the pipeline looks
no faster than one host. Time dilation (DieCast, NSDI'08, does it for whole clusters) runs
the emulated world ``D`` times slower than real time, so that the hosts rarely need a core
at the same moment:

- **compute**: every host computes ``D`` times slower than this machine, on top of its own
  ``slowdown`` (:class:`testbeds.emulation.Slowdown` with ``dilation=D``). A computation whose
  own time is ``t`` seconds of CPU (``testbeds.worker``: what the stage's computations of its
  kind typically use) ends ``D * slowdown * t`` seconds after it began: the sleep that
  fills the rest absorbs the time it waited for a core, as long as that is less than ``D``
  times its own (``D`` at least the number of hosts computing at once over the cores).
- **links**: every link carries ``D`` times less bandwidth with ``D`` times the latency
  (:func:`dilate_topology`; the testbed shapes the dilated figures).
- **reports**: every time measured is divided by ``D`` (rates multiplied) and labelled
  ``"dilated xD"`` (:func:`undilate_row`, :func:`dilation_label`); a JSON document carries
  ``"dilation": D`` at its top level.
- **timeouts**: what waits on the emulated world waits ``D`` times longer (the
  coordinator's heartbeat timeout, :func:`dilated_timeout_s`), passed as larger flags by the
  testbed's launcher, never changed in the product.

What is not dilated: the work outside the stages' forward and backward computations (the
executor's and gRPC's own CPU time, the optimizer step) runs at this machine's speed, so it
counts ``1/D`` of its real length in a dilated report. Keep it small beside the compute, or
compare runs dilated alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fusion.errors import ConfigError
from scheduler.topology import Topology

#: Row keys of a benchmark result that are seconds of the emulated world (divided by ``D``).
TIME_KEYS = ("step_s", "predicted_step_s", "time_to_target_s")
#: Row keys that are lists or maps of such seconds.
TIME_SEQUENCE_KEYS = ("step_s_rounds", "compute_s")
#: Row keys that are rates per second (multiplied by ``D``).
RATE_KEYS = ("samples_per_s", "tokens_per_s")


def check_dilation(dilation: float) -> float:
    """``dilation`` as a float, or ``ConfigError``: a finite number >= 1 (1: none)."""
    if (
        isinstance(dilation, bool)
        or not isinstance(dilation, (int, float))
        or not math.isfinite(dilation)
        or dilation < 1.0
    ):
        raise ConfigError(f"dilation must be a finite number >= 1 (1: none), got {dilation!r}")
    return float(dilation)


def dilation_label(dilation: float) -> str:
    """How a dilated report says so: ``"dilated x4"`` (empty for 1)."""
    return "" if dilation == 1.0 else f"dilated x{dilation:g}"


def dilate_topology(topology: Topology, dilation: float) -> Topology:
    """``topology`` with every link ``dilation`` times slower: bandwidth divided, latency
    multiplied (the driver's links too). Hosts are unchanged: their compute is dilated by
    the workers (``testbeds.worker --dilate``)."""
    d = check_dilation(dilation)
    if d == 1.0:
        return topology
    bandwidth = [
        [bw if i == j else bw / d for j, bw in enumerate(row)] for i, row in enumerate(topology.bandwidth_bytes_per_s)
    ]
    latency = [[lat * d for lat in row] for row in topology.latency_s]
    driver = None
    if topology.driver_links is not None:
        driver = tuple((rtt * d, bw / d) for rtt, bw in topology.driver_links)
    return replace(topology, bandwidth_bytes_per_s=bandwidth, latency_s=latency, driver_links=driver)


def dilated_timeout_s(timeout_s: float, dilation: float) -> float:
    """A timeout on the emulated world's progress, ``dilation`` times longer."""
    return timeout_s * check_dilation(dilation)


def undilate_s(seconds: float | None, dilation: float) -> float | None:
    """Seconds measured on a dilated testbed, in the emulated world's time (``None`` stays)."""
    return None if seconds is None else seconds / dilation


def undilate_row(row: Mapping[str, Any], dilation: float) -> dict[str, Any]:
    """A benchmark row (``systems.NAME`` of ``testbeds.bench``) in the emulated world's time:
    :data:`TIME_KEYS` divided by ``dilation``, :data:`TIME_SEQUENCE_KEYS` element-wise,
    :data:`RATE_KEYS` multiplied; everything else as it was."""
    d = check_dilation(dilation)
    out = dict(row)
    if d == 1.0:
        return out
    for key in TIME_KEYS:
        if isinstance(out.get(key), (int, float)):
            out[key] = out[key] / d
    for key in TIME_SEQUENCE_KEYS:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [v / d for v in value]
        elif isinstance(value, dict):
            out[key] = {k: v / d for k, v in value.items()}
    for key in RATE_KEYS:
        if isinstance(out.get(key), (int, float)):
            out[key] = out[key] * d
    return out


def dilated_slowdowns(slowdowns: Mapping[str, float], hosts: list[str], dilation: float) -> dict[str, float]:
    """Every host's compute factor on a testbed dilated ``dilation`` times: its own slowdown
    (1 where ``slowdowns`` names none) times ``dilation`` (for processes that take one
    factor, such as the baselines' ranks: ``--slowdown``)."""
    d = check_dilation(dilation)
    if d == 1.0:
        return dict(slowdowns)
    return {h: slowdowns.get(h, 1.0) * d for h in hosts}
