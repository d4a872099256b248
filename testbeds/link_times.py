"""Measured message times of a testbed's links, for the simulator to replay.

The simulator prices a transfer as ``latency + bytes / bandwidth``. A single message after
a pause, with a receiver that says nothing until all of it is in (gloo's point-to-point
sends, which the pipelining baseline makes once per micro-batch), does not take that on
the emulated long links: over three-continents' 100 Mbps, 40 ms one-way link every
message of 32-512 KB took 120-124 ms to the receiver's answer where the model gives
83-122 ms, and over its 8 Mbps, 150 ms links 32-128 KB took 446-460 ms against 334-437 ms
(a stall of about half a round trip, the receiver's delayed acknowledgement as the likely
cause: the sender waits on it for its last segments). fusion's gRPC transfers do not pay
it (HTTP/2 window updates acknowledge as the data is read): uniform on three-continents,
link-bound, was priced within 1 % by the configured links, and 22 % too slow by the
measured ones. So :mod:`testbeds.sim_validation` prices the gloo baselines' transfers from
these curves and fusion's from the configured links. One run per topology:

    python -m testbeds.link_times three-continents      # root: the netns backend
    # -> testbeds/results/links-three-continents.json

For each ordered pair of clusters (and inside each cluster with two hosts), one host pair
times a message of each size in :data:`SIZES`, each after :data:`IDLE_S` of quiet, until
the receiver's one-byte answer (``python -m testbeds.measure transfers`` on the hosts
themselves, a fresh connection per size warmed with messages of that size).
:class:`MeasuredTopology` then prices every transfer between those clusters from that
curve (linear between sizes; beyond the largest, at the link's rate).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import ConfigError, FusionError
from scheduler.topology import Topology

#: Message sizes measured (bytes): a micro-batch's activations in the benchmark jobs are
#: 64 KB - 1 MB; the ends anchor the latency and the rate.
SIZES = (1 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20)
#: Quiet before each message: longer than a stage's compute between its sends here.
IDLE_S = 0.1
REPEATS = 3
RESULTS = Path(__file__).resolve().parent / "results"


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


def link_classes(topology: Topology) -> dict[tuple[str, str], tuple[str, str]]:
    """One ``(src host, dst host)`` per ordered cluster pair (inside a cluster: its first
    two hosts; a cluster of one host has no inside link)."""
    members: dict[str, list[str]] = {}
    for w in topology.workers:
        members.setdefault(w.cluster, []).append(w.name)
    out = {}
    for a, hosts_a in members.items():
        for b, hosts_b in members.items():
            if a == b:
                if len(hosts_a) > 1:
                    out[(a, a)] = (hosts_a[0], hosts_a[1])
            else:
                out[(a, b)] = (hosts_a[0], hosts_b[0])
    return out


def measure(
    topology: str | Path, *, backend: str = "netns", sizes: Sequence[int] = SIZES, echo: Any = print
) -> dict[str, Any]:
    """Bring the testbed up, time every link class, tear it down; the document
    :func:`with_link_times` reads."""
    from testbeds.net import open_testbed

    with open_testbed(topology, backend=backend) as tb:
        return measure_testbed(tb, sizes=sizes, echo=echo)


def measure_testbed(tb: Any, *, sizes: Sequence[int] = SIZES, echo: Any = print) -> dict[str, Any]:
    """:func:`measure` on a running :class:`~testbeds.net.Testbed`."""
    from fusion.launch import child_env
    from testbeds.net import wait_for_line

    links: dict[str, Any] = {}
    env = child_env()
    for (a, b), (src, dst) in link_classes(tb.topology).items():
        port = tb.free_port(dst)
        routes = tb.expose(dst, port)
        log = tb.workdir / f"answer-{dst}-{port}.log"
        with open(log, "w") as f:
            server = tb.spawn(
                dst,
                [sys.executable, "-m", "testbeds.measure", "answer", "--listen", f"{tb.address(dst)}:{port}"],
                env=env,
                stdout=f,
            )
        try:
            wait_for_line(log, r"ready", server, 30)
            client = tb.spawn(
                src,
                [
                    sys.executable,
                    "-m",
                    "testbeds.measure",
                    "transfers",
                    "--to",
                    routes[src],
                    "--sizes",
                    ",".join(map(str, sizes)),
                    "--repeats",
                    str(REPEATS),
                    "--idle",
                    str(IDLE_S),
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            out, _ = client.communicate(timeout=600)
        finally:
            server.kill()
            server.wait(timeout=10)
        if client.returncode != 0:
            raise FusionError(f"timing {src} -> {dst} failed (exit {client.returncode})")
        seconds = json.loads(out)["seconds"]
        links[f"{a}->{b}"] = {"hosts": [src, dst], "seconds": seconds}
        echo(
            f"  {a} -> {b} ({src} -> {dst}): "
            + ", ".join(f"{s >> 10} KB {t * 1e3:.0f} ms" for s, t in zip(sizes, seconds, strict=False))
        )
    return {
        "topology": tb.label,
        "backend": tb.backend,
        "latency_mode": tb.latency_mode,
        "sizes": list(sizes),
        "idle_s": IDLE_S,
        "links": links,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.link_times", description=__doc__.split("\n\n")[0])
    p.add_argument("topology", help="shipped name or TOML path")
    p.add_argument("--backend", default="netns", choices=("netns", "proxy"))
    p.add_argument("--out", default=None, help="JSON path (default: testbeds/results/links-TOPOLOGY.json)")
    args = p.parse_args(argv)
    try:
        doc = measure(args.topology, backend=args.backend)
    except FusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else RESULTS / f"links-{doc['topology']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
