"""Measured message times of a testbed's links, for the simulator to replay.

The simulator prices a transfer as ``latency + bytes / bandwidth``; gloo's single messages
after a pause do not take that on the emulated long links (why, and how the simulator
prices them from these curves: :mod:`testbeds.sim.measured_links`). One run per topology:

    python -m testbeds.net.link_times three-continents      # root: the netns backend
    # -> testbeds/results/bench/links-three-continents.json

For each ordered pair of clusters (and inside each cluster with two hosts), one host pair
times a message of each size in :data:`SIZES`, each after :data:`IDLE_S` of quiet, until
the receiver's one-byte answer (``python -m testbeds.net.measure transfers`` on the hosts
themselves, a fresh connection per size warmed with messages of that size).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusion.errors import FusionError
from scheduler.topology import Topology

#: Message sizes measured (bytes): a micro-batch's activations in the benchmark jobs are
#: 64 KB - 1 MB; the ends anchor the latency and the rate.
SIZES = (1 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20)
#: Quiet before each message: longer than a stage's compute between its sends here.
IDLE_S = 0.1
REPEATS = 3
RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench"


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
    topology: str | Path,
    *,
    backend: str = "netns",
    sizes: Sequence[int] = SIZES,
    burst: int = 0,
    echo: Any = print,
) -> dict[str, Any]:
    """Bring the testbed up, time every link class, tear it down; the document
    :func:`testbeds.sim.measured_links.with_link_times` reads. ``burst``: bytes each new
    connection carries once before it is timed (the data plane's warm-up)."""
    from testbeds.net.backend import open_testbed

    with open_testbed(topology, backend=backend) as tb:
        return measure_testbed(tb, sizes=sizes, burst=burst, echo=echo)


def measure_testbed(tb: Any, *, sizes: Sequence[int] = SIZES, burst: int = 0, echo: Any = print) -> dict[str, Any]:
    """:func:`measure` on a running :class:`~testbeds.net.testbed.Testbed`."""
    from fusion.launch import child_env
    from testbeds.net.testbed import wait_for_line

    links: dict[str, Any] = {}
    env = child_env()
    for (a, b), (src, dst) in link_classes(tb.topology).items():
        port = tb.free_port(dst)
        routes = tb.expose(dst, port)
        log = tb.workdir / f"answer-{dst}-{port}.log"
        with open(log, "w") as f:
            server = tb.spawn(
                dst,
                [sys.executable, "-m", "testbeds.net.measure", "answer", "--listen", f"{tb.address(dst)}:{port}"],
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
                    "testbeds.net.measure",
                    "transfers",
                    "--to",
                    routes[src],
                    "--sizes",
                    ",".join(map(str, sizes)),
                    "--repeats",
                    str(REPEATS),
                    "--idle",
                    str(IDLE_S),
                    "--burst",
                    str(burst),
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
        "burst_bytes": burst,
        "links": links,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbeds.net.link_times", description=__doc__.split("\n\n")[0])
    p.add_argument("topology", help="shipped name or TOML path")
    p.add_argument("--backend", default="netns", choices=("netns", "proxy"))
    p.add_argument("--out", default=None, help="JSON path (default: testbeds/results/bench/links-TOPOLOGY.json)")
    p.add_argument(
        "--burst", type=int, default=0, help="bytes each new connection carries once before it is timed (default: none)"
    )
    args = p.parse_args(argv)
    try:
        doc = measure(args.topology, backend=args.backend, burst=args.burst)
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
