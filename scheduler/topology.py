"""Topology: the workers (speed, memory) and every directed link's latency and bandwidth.

A topology comes from a TOML file (the "Topology file" contract in DESIGN.md, used by the
testbeds and for offline planning) or from profiled numbers
(:meth:`Topology.from_measurements`). Either way it is plain data: two dense matrices
indexed by worker position, where ``[i][j]`` is the directed link ``i -> j`` and the time to
move ``size_bytes`` over it is modelled as ``latency_s + size_bytes / bandwidth_bytes_per_s``
(the same fit :mod:`fusion.profiling` makes over the real gRPC path).

Link rules in a file name hosts or clusters. For each ordered pair of distinct hosts
``(a, b)`` the rule that applies is the most specific one:

* specificity counts the endpoints that name a host: host→host (2) beats host→cluster and
  cluster→host (1), which beat cluster→cluster (0);
* a rule also covers the reverse direction (links are symmetric), unless a rule written for
  the exact direction has at least the same specificity;
* ``from = to = X`` with ``X`` a cluster sets the links between the hosts inside ``X``.

Two rules of equal specificity and direction that both cover a pair but disagree (say
``a-1 -> site-b`` and ``site-a -> b-1`` with different numbers) are a conflict and raise;
a host→host rule settles it. No torch here: the scheduler stays importable without it.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import PlanError

logger = logging.getLogger(__name__)

#: FLOP/s assumed for a host whose file gives no ``flops``: roughly one CPU socket's
#: fp32 matmul rate, or a small GPU's. Planning only compares hosts with one another, so
#: a file that gives no host a speed still plans evenly.
DEFAULT_FLOPS = 1.0e12

#: Bytes in one ``memory_gb`` (GiB).
GIB = 2**30

_HOST_KEYS = ("name", "cluster", "flops", "memory_gb", "slowdown", "machine")
_LINK_KEYS = ("from", "to", "bandwidth_mbps", "latency_ms")
_TOP_KEYS = ("hosts", "links")


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker (a host of a topology file): what it is called, where it sits, how fast it is."""

    name: str
    """Unique worker name."""
    cluster: str
    """Cluster label that link rules may name; a host given none is its own cluster (its name)."""
    flops: float = DEFAULT_FLOPS
    """Device speed in FLOP/s (> 0)."""
    memory_bytes: int | None = None
    """Memory cap in bytes for the worker's stages; ``None`` means unlimited."""
    slowdown: float = 1.0
    """Compute emulation factor on testbeds (>= 1): the worker behaves ``slowdown`` times slower."""
    machine: str | None = None
    """The machine (and device) the worker computes on, when known. Workers that name the
    same machine share its compute: the estimator does not let their stages compute at
    once (see :mod:`scheduler.estimator`). ``None``: a machine of its own."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"worker name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.cluster, str) or not self.cluster:
            raise PlanError(f"worker {self.name!r}: cluster must be a non-empty string, got {self.cluster!r}")
        if not _is_number(self.flops) or not (0.0 < self.flops < math.inf):
            raise PlanError(f"worker {self.name!r}: flops must be a positive finite number, got {self.flops!r}")
        if self.memory_bytes is not None and (
            not isinstance(self.memory_bytes, numbers.Integral)
            or isinstance(self.memory_bytes, bool)
            or self.memory_bytes <= 0
        ):
            raise PlanError(
                f"worker {self.name!r}: memory_bytes must be a positive integer or None, got {self.memory_bytes!r}"
            )
        if not _is_number(self.slowdown) or not (1.0 <= self.slowdown < math.inf):
            raise PlanError(f"worker {self.name!r}: slowdown must be a finite number >= 1.0, got {self.slowdown!r}")
        if self.machine is not None and (not isinstance(self.machine, str) or not self.machine):
            raise PlanError(f"worker {self.name!r}: machine must be a non-empty string or None, got {self.machine!r}")
        # Normalised so that specs built from numpy or TOML integers compare equal after JSON.
        object.__setattr__(self, "flops", float(self.flops))
        if self.memory_bytes is not None:
            object.__setattr__(self, "memory_bytes", int(self.memory_bytes))
        object.__setattr__(self, "slowdown", float(self.slowdown))

    @property
    def effective_flops(self) -> float:
        """FLOP/s the worker delivers once the testbed slowdown is applied."""
        return self.flops / self.slowdown


def _check_unambiguous(workers: Sequence[WorkerSpec]) -> None:
    """Reject a host name that is also the label of a cluster other than its own singleton one."""
    members: dict[str, list[str]] = {}
    for w in workers:
        members.setdefault(w.cluster, []).append(w.name)
    for w in workers:
        if w.name in members and members[w.name] != [w.name]:
            raise PlanError(
                f"{w.name!r} is both a host and the cluster label of {members[w.name]}; link rules could "
                f"not tell which is meant: rename the host or the cluster"
            )


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Workers and the directed links between them, as dense matrices in worker order."""

    workers: tuple[WorkerSpec, ...]
    """The workers; a worker's position is its index in the matrices."""
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]
    """``[i][j]``: bandwidth of the directed link ``i -> j`` (> 0, finite); the diagonal is ``math.inf``."""
    latency_s: tuple[tuple[float, ...], ...]
    """``[i][j]``: one-way latency of the link ``i -> j`` (>= 0, finite); the diagonal is ``0.0``."""
    driver_links: tuple[tuple[float, float], ...] | None = None
    """Per worker: ``(round_trip_s, bandwidth_bytes_per_s)`` of the driver's calls to it (the
    coordinator starts every step, feeds inputs and targets, waits and applies over these);
    ``None`` when unknown, and the estimator then leaves the driver's links out. The
    bandwidth is ``math.inf`` for a worker on the driver's own host."""
    paced_sends: bool = True
    """How a stage sends to another over these links: paced at the link's bandwidth, without
    waiting for answers (:mod:`executor.sender`, what a coordinator's job does); ``False``:
    one transfer at a time, each until its answer (a bare executor without link figures,
    and every run recorded before pacing)."""
    machine_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per worker, the index of the machine it computes on: workers whose
    :attr:`WorkerSpec.machine` is the same share one; a worker naming none has its own."""

    def __post_init__(self) -> None:
        workers = tuple(self.workers)
        if not workers or not all(isinstance(w, WorkerSpec) for w in workers):
            raise PlanError("a topology needs at least one worker, each a WorkerSpec")
        names = [w.name for w in workers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise PlanError(f"duplicate worker name(s) {dup}: every host needs a unique name")
        _check_unambiguous(workers)
        n = len(workers)
        matrices = {}
        for key in ("bandwidth_bytes_per_s", "latency_s"):
            rows = getattr(self, key)
            try:
                m = tuple(tuple(float(x) for x in row) for row in rows)
            except (TypeError, ValueError) as e:
                raise PlanError(f"{key} must be a {n}x{n} matrix of numbers: {e}") from e
            if len(m) != n or any(len(row) != n for row in m):
                raise PlanError(
                    f"{key} must be {n}x{n} (one row and column per worker), got {[len(r) for r in m]} row lengths"
                )
            matrices[key] = m
        for i in range(n):
            for j in range(n):
                bw, lat = matrices["bandwidth_bytes_per_s"][i][j], matrices["latency_s"][i][j]
                if i == j:
                    if bw != math.inf or lat != 0.0:
                        raise PlanError(
                            f"worker {names[i]!r}: the diagonal must be bandwidth inf and latency 0, got {bw}, {lat}"
                        )
                    continue
                if not (0.0 < bw < math.inf):
                    raise PlanError(
                        f"link {names[i]} -> {names[j]}: bandwidth must be positive and finite, got {bw} bytes/s"
                    )
                if not (0.0 <= lat < math.inf):
                    raise PlanError(f"link {names[i]} -> {names[j]}: latency must be >= 0 and finite, got {lat} s")
        object.__setattr__(self, "workers", workers)
        for key, m in matrices.items():
            object.__setattr__(self, key, m)
        if self.driver_links is not None:
            object.__setattr__(self, "driver_links", _check_driver_links(self.driver_links, names))
        machines: dict[object, int] = {}
        object.__setattr__(
            self,
            "machine_of",
            tuple(
                machines.setdefault(w.machine if w.machine is not None else (i,), len(machines))
                for i, w in enumerate(workers)
            ),
        )

    def __len__(self) -> int:
        """Number of workers."""
        return len(self.workers)

    def index(self, name: str) -> int:
        """Position of the worker called ``name``."""
        for i, w in enumerate(self.workers):
            if w.name == name:
                return i
        raise PlanError(f"unknown host {name!r}; the topology has {self.names()}")

    def names(self) -> list[str]:
        """Worker names in order."""
        return [w.name for w in self.workers]

    def clusters(self) -> dict[str, list[int]]:
        """Cluster label → indices of its workers, both in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, w in enumerate(self.workers):
            out.setdefault(w.cluster, []).append(i)
        return out

    def transfer_s(self, i: int, j: int, size_bytes: float) -> float:
        """Modelled seconds to move ``size_bytes`` from worker ``i`` to ``j`` (0 when ``i == j``)."""
        n = len(self)
        if not (0 <= i < n and 0 <= j < n):
            raise IndexError(f"worker index out of range: {i} -> {j} with {n} workers")
        if size_bytes < 0:
            raise PlanError(f"size_bytes must be >= 0, got {size_bytes}")
        if i == j:
            return 0.0
        return self.latency_s[i][j] + size_bytes / self.bandwidth_bytes_per_s[i][j]

    def bandwidth_matrix(self) -> np.ndarray:
        """A float64 copy of :attr:`bandwidth_bytes_per_s`, shape ``(n, n)``."""
        return np.array(self.bandwidth_bytes_per_s, dtype=np.float64)

    def latency_matrix(self) -> np.ndarray:
        """A float64 copy of :attr:`latency_s`, shape ``(n, n)``."""
        return np.array(self.latency_s, dtype=np.float64)

    def subset(self, indices: Sequence[int]) -> Topology:
        """The topology restricted to the workers at ``indices``, in that order."""
        idx = list(indices)
        n = len(self)
        bad = [i for i in idx if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise PlanError(f"subset indices {bad} are not worker indices (0..{n - 1})")
        if len(set(idx)) != len(idx):
            raise PlanError(f"subset indices {idx} repeat a worker")
        return Topology(
            workers=tuple(self.workers[i] for i in idx),
            bandwidth_bytes_per_s=tuple(tuple(self.bandwidth_bytes_per_s[i][j] for j in idx) for i in idx),
            latency_s=tuple(tuple(self.latency_s[i][j] for j in idx) for i in idx),
            driver_links=None if self.driver_links is None else tuple(self.driver_links[i] for i in idx),
            paced_sends=self.paced_sends,
        )

    def with_driver_links(self, links: Sequence[tuple[float, float]] | None) -> Topology:
        """The same topology with measured driver links (see :attr:`driver_links`)."""
        return replace(self, driver_links=None if links is None else tuple(links))

    def with_driver_at(self, host: int) -> Topology:
        """The driver runs on worker ``host``'s machine: its calls to each worker cross the
        links from that host (a round trip is the latency both ways)."""
        if not 0 <= host < len(self):
            raise PlanError(f"driver host index {host} is not a worker index (0..{len(self) - 1})")
        links = [
            (0.0, math.inf)
            if w == host
            else (self.latency_s[host][w] + self.latency_s[w][host], self.bandwidth_bytes_per_s[host][w])
            for w in range(len(self))
        ]
        return self.with_driver_links(links)

    def driver_link(self, w: int) -> tuple[float, float]:
        """``(round_trip_s, bandwidth_bytes_per_s)`` from the driver to worker ``w``; free when unknown."""
        return (0.0, math.inf) if self.driver_links is None else self.driver_links[w]

    def nearest_to_driver(self) -> int | None:
        """The worker with the shortest driver round trip (``None`` when the links are unknown)."""
        if self.driver_links is None:
            return None
        return min(range(len(self)), key=lambda w: (self.driver_links[w][0], -self.driver_links[w][1]))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; the infinite diagonal bandwidth is written as ``None`` (JSON null)."""
        return {
            "workers": [
                {
                    "name": w.name,
                    "cluster": w.cluster,
                    "flops": w.flops,
                    "memory_bytes": w.memory_bytes,
                    "slowdown": w.slowdown,
                }
                | ({} if w.machine is None else {"machine": w.machine})
                for w in self.workers
            ],
            "bandwidth_bytes_per_s": [
                [None if math.isinf(x) else x for x in row] for row in self.bandwidth_bytes_per_s
            ],
            "latency_s": [list(row) for row in self.latency_s],
            **(
                {}
                if self.driver_links is None
                else {"driver_links": [[rtt, None if math.isinf(bw) else bw] for rtt, bw in self.driver_links]}
            ),
            **({} if self.paced_sends else {"paced_sends": False}),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Topology:
        """Read :meth:`to_dict` output back."""
        if not isinstance(d, Mapping):
            raise PlanError(f"a topology document must be an object, got {type(d).__name__}")
        allowed = ("workers", "bandwidth_bytes_per_s", "latency_s", "driver_links", "paced_sends")
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise PlanError(f"topology document has unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
        try:
            workers = tuple(WorkerSpec(**w) for w in d["workers"])
            bandwidth = [[math.inf if x is None else x for x in row] for row in d["bandwidth_bytes_per_s"]]
            driver = d.get("driver_links")
            links = None if driver is None else tuple((rtt, math.inf if bw is None else bw) for rtt, bw in driver)
            paced = d.get("paced_sends", True)
            if not isinstance(paced, bool):
                raise PlanError(f"paced_sends must be true or false, got {paced!r}")
            return Topology(
                workers=workers,
                bandwidth_bytes_per_s=bandwidth,
                latency_s=d["latency_s"],
                driver_links=links,
                paced_sends=paced,
            )
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a valid topology document: {e!r}") from e

    @staticmethod
    def from_json(text: str) -> Topology:
        """Read :meth:`to_json` output back."""
        try:
            return Topology.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"topology is not valid JSON: {e}") from e

    @staticmethod
    def from_measurements(
        workers: Sequence[WorkerSpec],
        latency_s: Sequence[Sequence[float]],
        bandwidth_bytes_per_s: Sequence[Sequence[float]],
    ) -> Topology:
        """Build a topology from profiled per-link numbers (``[i][j]`` for ``i -> j``).

        The diagonals of the given matrices are ignored (a worker does not talk to itself
        over the network); every off-diagonal entry must be a measured, valid number.
        """
        n = len(workers)
        mats = {}
        for key, given in (("latency_s", latency_s), ("bandwidth_bytes_per_s", bandwidth_bytes_per_s)):
            try:
                m = np.array(given, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise PlanError(f"{key} must be a {n}x{n} matrix of numbers for {n} workers: {e}") from e
            if m.shape != (n, n):
                raise PlanError(f"{key} has shape {m.shape}; {n} workers need ({n}, {n})")
            np.fill_diagonal(m, math.inf if key == "bandwidth_bytes_per_s" else 0.0)
            nan = np.argwhere(np.isnan(m))
            if len(nan):
                i, j = (int(x) for x in nan[0])
                raise PlanError(f"{key} has no measurement for {workers[i].name} -> {workers[j].name} (NaN)")
            mats[key] = m.tolist()
        return Topology(
            workers=tuple(workers), latency_s=mats["latency_s"], bandwidth_bytes_per_s=mats["bandwidth_bytes_per_s"]
        )

    @staticmethod
    def load(path: str | Path) -> Topology:
        """Read a topology TOML file."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PlanError(f"cannot read topology file {path}: {e.strerror or e}") from e
        return Topology.from_toml(text, source=str(path))

    @staticmethod
    def from_toml(text: str, *, source: str = "<string>") -> Topology:
        """Parse the TOML topology format (the contract in DESIGN.md); ``source`` names it in errors."""
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"at line (\d+)", str(e))
            where = f"{source}:{m.group(1)}" if m else source
            raise PlanError(f"{where}: invalid TOML: {e}") from e
        unknown = sorted(set(doc) - set(_TOP_KEYS))
        if unknown:
            raise PlanError(f"{source}: unknown top-level key(s) {unknown}; allowed: {', '.join(_TOP_KEYS)}")
        hosts, links = doc.get("hosts", []), doc.get("links", [])
        if not isinstance(hosts, list) or not hosts:
            raise PlanError(f"{source}: no hosts; give at least one [[hosts]] table with a name")
        if not isinstance(links, list):
            raise PlanError(f"{source}: links must be an array of [[links]] tables")
        workers = tuple(_parse_host(h, k, source) for k, h in enumerate(hosts))
        names = [w.name for w in workers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise PlanError(f"{source}: duplicate host name(s) {dup}: every host needs a unique name")
        try:
            _check_unambiguous(workers)
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None
        rules = _parse_links(links, workers, source)
        bandwidth, latency = _resolve_links(workers, rules, source)
        return Topology(workers=workers, bandwidth_bytes_per_s=bandwidth, latency_s=latency)


def _check_driver_links(links: object, names: Sequence[str]) -> tuple[tuple[float, float], ...]:
    """Validated :attr:`Topology.driver_links`: one ``(round_trip_s >= 0, bandwidth > 0)`` per worker."""
    try:
        out = tuple((float(rtt), float(bw)) for rtt, bw in links)  # type: ignore[union-attr]
    except (TypeError, ValueError) as e:
        raise PlanError(f"driver_links must be one (round_trip_s, bandwidth_bytes_per_s) pair per worker: {e}") from e
    if len(out) != len(names):
        raise PlanError(f"driver_links has {len(out)} entries; the topology has {len(names)} workers")
    for name, (rtt, bw) in zip(names, out, strict=False):
        if not (0.0 <= rtt < math.inf) or not bw > 0.0:
            raise PlanError(
                f"driver link to {name!r}: round trip must be >= 0 and finite and bandwidth positive, got {rtt}, {bw}"
            )
    return out


def _parse_host(h: object, k: int, source: str) -> WorkerSpec:
    if not isinstance(h, dict):
        raise PlanError(f"{source}: hosts[{k}] must be a table ([[hosts]])")
    name = h.get("name")
    label = f"{source}: hosts[{k}]" + (f" ({name!r})" if isinstance(name, str) else "")
    unknown = sorted(set(h) - set(_HOST_KEYS))
    if unknown:
        raise PlanError(f"{label}: unknown key(s) {unknown}; allowed: {', '.join(_HOST_KEYS)}")
    if not isinstance(name, str) or not name:
        raise PlanError(f"{label}: 'name' is required and must be a non-empty string")
    for key in ("flops", "memory_gb", "slowdown"):
        if key in h and not _is_number(h[key]):
            raise PlanError(f"{label}: {key} must be a number, got {h[key]!r}")
    memory_gb = h.get("memory_gb")
    if memory_gb is not None and not (0 < memory_gb < math.inf):
        raise PlanError(f"{label}: memory_gb must be positive, got {memory_gb}")
    try:
        return WorkerSpec(
            name=name,
            cluster=h.get("cluster", name),
            flops=h.get("flops", DEFAULT_FLOPS),
            memory_bytes=None if memory_gb is None else int(round(memory_gb * GIB)),
            slowdown=h.get("slowdown", 1.0),
            machine=h.get("machine"),
        )
    except PlanError as e:
        raise PlanError(f"{label}: {e}") from None


@dataclass(frozen=True)
class _Rule:
    """One ``[[links]]`` table, with its endpoints resolved to sets of host indices."""

    k: int
    src: str
    dst: str
    src_hosts: frozenset[int]
    dst_hosts: frozenset[int]
    specificity: int
    """Number of endpoints that name a host (0, 1 or 2)."""
    bandwidth_bytes_per_s: float
    latency_s: float

    def __str__(self) -> str:
        return f"links[{self.k}] ({self.src} -> {self.dst})"


def _parse_links(links: list[object], workers: Sequence[WorkerSpec], source: str) -> list[_Rule]:
    host_idx = {w.name: i for i, w in enumerate(workers)}
    cluster_idx: dict[str, list[int]] = {}
    for i, w in enumerate(workers):
        cluster_idx.setdefault(w.cluster, []).append(i)

    def endpoint(value: object, key: str, label: str) -> tuple[frozenset[int], int]:
        if not isinstance(value, str) or not value:
            raise PlanError(f"{label}: {key!r} is required and must name a host or a cluster")
        if value in host_idx:  # a host alone in its own cluster of the same name is the host
            return frozenset([host_idx[value]]), 1
        if value in cluster_idx:
            return frozenset(cluster_idx[value]), 0
        raise PlanError(
            f"{label}: {key} = {value!r} is neither a host nor a cluster; "
            f"hosts: {sorted(host_idx)}, clusters: {sorted(cluster_idx)}"
        )

    rules: list[_Rule] = []
    seen: dict[tuple[str, str], int] = {}
    for k, link in enumerate(links):
        label = f"{source}: links[{k}]"
        if not isinstance(link, dict):
            raise PlanError(f"{label} must be a table ([[links]])")
        if isinstance(link.get("from"), str) and isinstance(link.get("to"), str):
            label += f" ({link['from']} -> {link['to']})"
        unknown = sorted(set(link) - set(_LINK_KEYS))
        if unknown:
            raise PlanError(f"{label}: unknown key(s) {unknown}; allowed: {', '.join(_LINK_KEYS)}")
        src_hosts, src_spec = endpoint(link.get("from"), "from", label)
        dst_hosts, dst_spec = endpoint(link.get("to"), "to", label)
        src, dst = link["from"], link["to"]
        if src == dst and src_spec == 1:
            raise PlanError(
                f"{label}: a link from host {src!r} to itself; from = to must name a cluster of several hosts"
            )
        if (src, dst) in seen:
            raise PlanError(f"{label}: duplicate of links[{seen[(src, dst)]}] (same from, to and direction); keep one")
        seen[(src, dst)] = k
        mbps = link.get("bandwidth_mbps")
        if not _is_number(mbps) or not (0 < mbps < math.inf):
            raise PlanError(
                f"{label}: bandwidth_mbps is required and must be a positive number (megabits/s), got {mbps!r}"
            )
        latency_ms = link.get("latency_ms", 0.0)
        if not _is_number(latency_ms) or not (0 <= latency_ms < math.inf):
            raise PlanError(f"{label}: latency_ms must be a number >= 0 (milliseconds), got {latency_ms!r}")
        rule = _Rule(
            k=k,
            src=src,
            dst=dst,
            src_hosts=src_hosts,
            dst_hosts=dst_hosts,
            specificity=src_spec + dst_spec,
            bandwidth_bytes_per_s=mbps * 1e6 / 8,  # megabits/s -> bytes/s
            latency_s=latency_ms / 1e3,
        )
        if not any(a != b for a in src_hosts for b in dst_hosts):
            logger.warning("%s: %s covers no pair of distinct hosts", source, rule)
        rules.append(rule)
    return rules


def _resolve_links(
    workers: Sequence[WorkerSpec], rules: Sequence[_Rule], source: str
) -> tuple[list[list[float]], list[list[float]]]:
    """Pick the applicable rule for every ordered pair (module docstring) and fill the matrices."""
    n = len(workers)
    bandwidth = [[math.inf if i == j else 0.0 for j in range(n)] for i in range(n)]
    latency = [[0.0] * n for _ in range(n)]
    missing: list[tuple[int, int]] = []
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            forward = [r for r in rules if a in r.src_hosts and b in r.dst_hosts]
            reverse = [r for r in rules if b in r.src_hosts and a in r.dst_hosts]
            best_fwd = max((r.specificity for r in forward), default=-1)
            best_rev = max((r.specificity for r in reverse), default=-1)
            if best_fwd < 0 and best_rev < 0:
                missing.append((a, b))
                continue
            # The exact direction wins ties: a reverse rule applies only when strictly more specific.
            if best_fwd >= best_rev:
                chosen = [r for r in forward if r.specificity == best_fwd]
            else:
                chosen = [r for r in reverse if r.specificity == best_rev]
            rule = chosen[0]
            for other in chosen[1:]:
                if (other.bandwidth_bytes_per_s, other.latency_s) != (rule.bandwidth_bytes_per_s, rule.latency_s):
                    raise PlanError(
                        f"{source}: {rule} and {other} both set {workers[a].name} -> {workers[b].name} with the same "
                        f"specificity but different numbers; add a host-to-host rule for that pair"
                    )
            bandwidth[a][b] = rule.bandwidth_bytes_per_s
            latency[a][b] = rule.latency_s
    if missing:
        a, b = missing[0]
        wa, wb = workers[a], workers[b]
        hint = (
            f'from = "{wa.cluster}"\nto = "{wb.cluster}"'
            if wa.cluster != wb.cluster
            else f'from = "{wa.cluster}"\nto = "{wa.cluster}"'
        )
        more = f" (and {len(missing) - 1} more pair(s))" if len(missing) > 1 else ""
        raise PlanError(
            f"{source}: no link rule covers {wa.name} -> {wb.name} (clusters {wa.cluster!r} and {wb.cluster!r}){more}; "
            f"add a rule, e.g. a cluster-level one:\n[[links]]\n{hint}\nbandwidth_mbps = ...\nlatency_ms = ..."
        )
    return bandwidth, latency
