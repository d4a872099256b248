"""One injector per kind of chaos event: how it starts, and how it ends.

An injector's :meth:`Injector.start` does the harm and returns what it did in a few words;
:meth:`Injector.end` undoes it when the event's duration is over (thaw, link up, rate back,
file deleted, replacement started, coordinator restarted). An event that cannot be
injected here (no live worker, no root for ``ip``/``tc``, the proxy backend has no link to
cut) raises :class:`NotInjected` with the reason: the report lists it as such and does not
count it.
"""

from __future__ import annotations

import abc
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from fusion.errors import FusionError
from testbeds.chaos.fleet import ChaosFleet, FleetWorker
from testbeds.chaos.schedule import Event

logger = logging.getLogger(__name__)


class NotInjected(FusionError):
    """This event could not be injected on this testbed (the message says why)."""


class Injector(abc.ABC):
    """Base: one event of one kind, started then ended."""

    def __init__(self, fleet: ChaosFleet, event: Event, *, disk_dir: Path | None = None) -> None:
        self.fleet = fleet
        self.tb = fleet.tb
        self.event = event
        self.disk_dir = disk_dir
        self.target = ""
        """The worker or host the event hit."""

    @abc.abstractmethod
    def start(self) -> str:
        """Inject the event; returns what was done, for the report."""

    def end(self) -> str:
        return ""

    def _pick_worker(self, *, thawed_only: bool = True) -> FleetWorker:
        live = [w for w in self.fleet.live_workers() if not (thawed_only and w.frozen)]
        if not live:
            raise NotInjected("no live worker to hit")
        w = live[self.event.target_idx % len(live)]
        self.target = w.name
        return w

    def _replacement(self, host: str) -> str:
        name = self.fleet.new_worker_name(host)
        self.fleet.start_worker(host, name, wait=False)
        return f"replacement {name} started on {host}"


class Kill(Injector):
    """SIGKILL a worker; a replacement joins when the event ends (if the schedule says so)."""

    def start(self) -> str:
        w = self._pick_worker(thawed_only=False)
        self.host = w.host
        w.gone = True
        os.killpg(w.proc.pid, signal.SIGKILL)
        return f"SIGKILL {w.name} (pid {w.proc.pid})"

    def end(self) -> str:
        return self._replacement(self.host) if self.event.replace else ""


class Leave(Kill):
    """Ctrl-C (SIGINT) a worker: it hands its state off and deregisters."""

    def start(self) -> str:
        w = self._pick_worker()
        self.host = w.host
        w.gone = True
        self.fleet.signal_worker(w, signal.SIGINT)
        return f"SIGINT (Ctrl-C) {w.name} (pid {w.proc.pid})"


class Join(Injector):
    """A new worker joins."""

    def start(self) -> str:
        host = self.tb.hosts[self.event.target_idx % len(self.tb.hosts)]
        name = self.fleet.new_worker_name(host)
        self.target = name
        self.fleet.start_worker(host, name, wait=False)
        return f"{name} started on {host}"


class Freeze(Injector):
    """SIGSTOP a worker for longer than the heartbeat timeout, then SIGCONT."""

    def start(self) -> str:
        self.worker = self._pick_worker()
        self.worker.frozen = True
        self.fleet.signal_worker(self.worker, signal.SIGSTOP)
        return f"SIGSTOP {self.worker.name} for {self.event.duration_s:.1f}s"

    def end(self) -> str:
        self.worker.frozen = False
        try:
            self.fleet.signal_worker(self.worker, signal.SIGCONT)
        except ProcessLookupError:
            return f"{self.worker.name} is gone (not thawed)"
        return f"SIGCONT {self.worker.name}"


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, check=False, capture_output=True, text=True)
    if r.returncode != 0:
        raise NotInjected(f"'{' '.join(argv)}' failed: {r.stderr.strip() or r.stdout.strip()}")


class LinkCut(Injector):
    """Take a worker's host off the network (``ip link set eth0 down`` in its namespace), then back up.

    Taking a device down drops the routes through it that the kernel did not make itself
    (the delay line's table, :mod:`testbeds.net.netns`); they are read before the cut and put
    back after it, so that the link heals as a real one would.
    """

    def start(self) -> str:
        if self.tb.backend != "netns":
            raise NotInjected("a link cut needs the netns backend (the proxy backend has no link to take down)")
        w = self._pick_worker()
        self.ns = self.tb.namespace(w.host)  # type: ignore[attr-defined]
        self.target = w.host
        r = subprocess.run(["ip", "-n", self.ns, "route", "show", "table", "all"], capture_output=True, text=True)
        self.routes = [
            line.split()
            for line in r.stdout.splitlines()
            if " dev eth0" in line and "proto kernel" not in line and line.split()[0] not in _KERNEL_ROUTE_TYPES
        ]
        _run(["ip", "-n", self.ns, "link", "set", "eth0", "down"])
        return f"eth0 of {w.host} down (worker {w.name}) for {self.event.duration_s:.1f}s"

    def end(self) -> str:
        _run(["ip", "-n", self.ns, "link", "set", "eth0", "up"])
        for route in self.routes:
            _run(["ip", "-n", self.ns, "route", "replace", *route])
        return f"eth0 of {self.target} up ({len(self.routes)} route(s) put back)"


#: Route types the kernel keeps for itself (``ip route show table all``).
_KERNEL_ROUTE_TYPES = ("local", "broadcast", "multicast", "anycast")


class BandwidthCollapse(Injector):
    """Every link out of and into a worker's host drops to a fraction of its rate, then back."""

    def _set(self, host: str, fraction: float) -> None:
        if self.tb.backend == "proxy":
            for other in self.tb.hosts:
                if other != host:
                    for src, dst in ((host, other), (other, host)):
                        bw, _ = self.tb.link(src, dst)
                        self.tb.shaper(src, dst).bandwidth_bytes_per_s = bw * fraction  # type: ignore[attr-defined]
            return
        for src in self.tb.hosts:
            for dst in self.tb.hosts:
                if src == dst or host not in (src, dst):
                    continue
                bw, _ = self.tb.link(src, dst)
                rate_bit = max(8000, int(bw * 8 * fraction))
                cls = f"{self.tb.index(dst) + 16:x}"
                ns = self.tb.namespace(src)  # type: ignore[attr-defined]
                _run(["tc", "-n", ns, "class", "change", "dev", "eth0", "parent", "1:", "classid", f"1:{cls}",
                      "htb", "rate", f"{rate_bit}bit", "ceil", f"{rate_bit}bit"])  # fmt: skip

    def start(self) -> str:
        w = self._pick_worker()
        self.host = w.host
        self.target = w.host
        frac = float(self.event.params.get("fraction", 0.05))
        self._set(w.host, frac)
        return f"links of {w.host} at {100 * frac:g} % of their rate for {self.event.duration_s:.1f}s"

    def end(self) -> str:
        self._set(self.host, 1.0)
        return f"links of {self.host} back to their rate"


class SlowLoris(Injector):
    """Hostile connections to a worker's executor or the coordinator: trickle bytes or never read."""

    def start(self) -> str:
        at = self.event.params.get("at", "worker")
        if at == "coordinator":
            address, self.target = self.fleet.coordinator, "coordinator"
        else:
            w = self._pick_worker()
            address = _listen_address(w)
        src = self.tb.hosts[(self.event.target_idx // 7) % len(self.tb.hosts)]
        mode = self.event.params.get("mode", "trickle")
        n = int(self.event.params.get("connections", 8))
        self.proc = self.tb.spawn(
            src,
            [
                sys.executable,
                "-m",
                "testbeds.chaos.loris",
                address,
                "--mode",
                mode,
                "--connections",
                str(n),
                "--seconds",
                f"{self.event.duration_s:.1f}",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.fleet.started.append(self.proc)
        return f"{n} {mode} connection(s) from {src} to {self.target} ({address})"

    def end(self) -> str:
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return "slow-loris gone"


def _listen_address(w: FleetWorker) -> str:
    argv = w.proc.args
    return str(argv[argv.index("--listen") + 1])  # type: ignore[union-attr]


class CoordinatorRestart(Injector):
    """SIGKILL the coordinator; restart it on the same address and state dir when the event ends."""

    def start(self) -> str:
        self.target = "coordinator"
        pid = self.fleet.coordinator_proc.pid if self.fleet.coordinator_proc else None
        self.fleet.kill_coordinator()
        return f"SIGKILL coordinator (pid {pid}); restart in {self.event.duration_s:.1f}s"

    def end(self) -> str:
        self.fleet.start_coordinator()
        assert self.fleet.coordinator_proc is not None
        return f"coordinator restarted (pid {self.fleet.coordinator_proc.pid}, start #{self.fleet.coordinator_starts})"


class DiskFull(Injector):
    """Fill the small tmpfs under the job's output directory with one file; delete it when the event ends."""

    def start(self) -> str:
        if self.disk_dir is None:
            raise NotInjected("no small tmpfs under the output directory (needs root to mount one)")
        self.target = str(self.disk_dir)
        self.path = self.disk_dir / ".chaos-fill"
        written = 0
        try:
            with open(self.path, "wb") as f:
                block = b"\0" * (1 << 20)
                while True:
                    f.write(block)
                    f.flush()
                    written += len(block)
        except OSError:
            pass  # ENOSPC: the point
        st = os.statvfs(self.disk_dir)
        return f"{self.disk_dir} filled ({written / 2**20:.0f} MiB written, {st.f_bavail * st.f_frsize} bytes free)"

    def end(self) -> str:
        self.path.unlink(missing_ok=True)
        return f"{self.path.name} deleted"


INJECTORS: dict[str, type[Injector]] = {
    "kill": Kill,
    "freeze": Freeze,
    "link_cut": LinkCut,
    "bandwidth_collapse": BandwidthCollapse,
    "slow_loris": SlowLoris,
    "join": Join,
    "leave": Leave,
    "coordinator_restart": CoordinatorRestart,
    "disk_full": DiskFull,
}
"""The injector of each kind in :data:`testbeds.chaos.schedule.KINDS`."""
