"""The ``netns`` backend: one network namespace per host, ``tc`` shaping per destination.

Layout, for a testbed with prefix ``fz123-``::

    fz123-sw        a switch namespace holding bridge br0 and one veth end per host (h0, h1, ...)
    fz123-<host>    one namespace per host: lo, and eth0 = 10.77.X.Y/16, the peer of h<k>

Nothing is created in the caller's namespace, so testbeds never collide on addresses or
interface names; only namespace names carry the prefix. Each host shapes its own egress:
eth0 has an ``htb`` root with one class per destination host (``rate`` = ``ceil`` = the
link's bandwidth) and a ``u32`` filter on the destination IP, so every directed link gets
its own bandwidth. Latency, by what the kernel offers (``latency_mode`` says which):

- ``netem``: a ``netem`` leaf under each class (detected by adding one to a namespace's
  ``lo``); every packet is delayed.
- ``tun``: no ``sch_netem``, but TUN devices. Each host with a link of 1 ms or more routes
  those destinations through a TUN device served by :mod:`testbeds.net.delayline`, which holds
  each packet for its link's latency and hands it on to ``eth0`` and its ``htb`` class.
  Every packet is delayed here too: gloo's all-reduce as much as fusion's gRPC.
- ``userspace``: neither. A user-space delay proxy (:class:`testbeds.net.proxy.LinkProxy` with
  no bandwidth limit) in the source host's namespace on the peer-mapped fusion path only:
  packets that do not use the peer map (ping, gloo, the workers' control traffic to the
  coordinator) see the bandwidth but no latency.

Links under 1 ms (a lab fabric, a campus LAN) skip the user-space hops of the last two:
the hop would add about as much delay as the link has, and CPU.

``htb`` counts whole frames (Ethernet + IP + TCP headers), so a bulk TCP transfer's payload
rate is about 95 % of the configured rate with 1500-byte frames, as on a real link.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from scheduler.topology import Topology
from testbeds.net.proxy import LinkProxy, LinkShaper
from testbeds.net.testbed import (
    PEER_MAP_ENV,
    Testbed,
    TestbedError,
    netns_available,
    wait_for_line,
)

logger = logging.getLogger(__name__)

#: Host k's address is 10.77.(k // 250).(k % 250 + 1) on a /16 (each testbed is isolated).
SUBNET_PREFIX = "10.77"
#: htb class parameters. Burst: at least 2 ms of the rate (timer granularity at 1 Gbps) and
#: a few frames (slow links); quantum only matters between classes of one host.
BURST_S = 0.002
MIN_BURST_BYTES = 20_000
QUANTUM_BYTES = 30_000
CLONE_NEWNET = 0x40000000
#: Without ``sch_netem``, links with less latency than this (both ways) skip the user-space
#: delay proxy: the emulated delay is then what the veth path has (tens of microseconds).
DIRECT_LATENCY_S = 1e-3
NETNS_DIR = Path("/run/netns")
#: The TUN device of a host's delay line, and the routing table that takes what it hands
#: back on to eth0 (``tun`` latency mode).
DELAY_TUN = "dly0"
DELAY_TABLE = "100"
#: Queue of a delayed link's htb class, in round trips of the link (plus 50 ms): forwarded
#: packets have no socket back-pressure, so without a limit a bulk transfer would queue
#: the default 1,000 frames (1.5 s on an 8 Mbps link) in front of everything else.
DELAYED_QUEUE_RTTS = 2

_libc = ctypes.CDLL(None, use_errno=True)
#: One htb class and its counter in ``tc -s class show``: "class htb 1:12 ... Sent 1234 bytes".
_CLASS_SENT = re.compile(r"class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TestbedError(f"'ip {' '.join(args)}' failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise TestbedError(f"setns failed: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the body with this thread inside namespace ``name`` (sockets made there stay there)."""
    with open(NETNS_DIR / name) as target, open("/proc/thread-self/ns/net") as here:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(here.fileno())


def netns_socket(name: str) -> socket.socket:
    """A TCP socket in namespace ``name``."""
    with in_netns(name):
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


def list_namespaces() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    r = _ip("netns", "pids", name, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def delete_namespace(name: str) -> None:
    """Kill every process inside ``name``, then delete it (its veths and bridge go with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = namespace_pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if not pids:
            break
        _wait_gone(pids, 3.0)
    r = _ip("netns", "del", name, check=False)
    if r.returncode != 0 and name in list_namespaces():
        raise TestbedError(f"cannot delete namespace {name}: {r.stderr.strip()}")


def _wait_gone(pids: Sequence[int], timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() for p in pids):
            return
        time.sleep(0.05)


def netem_available(namespace: str) -> bool:
    """Whether this kernel has ``sch_netem``: try one on ``lo`` of a scratch namespace."""
    r = subprocess.run(
        ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        check=False,
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)
        return True
    logger.info("no netem here (%s)", r.stderr.strip())
    return False


def tun_available(namespace: str) -> bool:
    """Whether TUN devices can be made here: try one in a scratch namespace."""
    if not Path("/dev/net/tun").exists():
        logger.info("no /dev/net/tun here")
        return False
    r = _ip("-n", namespace, "tuntap", "add", "dev", "probe0", "mode", "tun", check=False)
    if r.returncode != 0:
        logger.info("cannot make a TUN device (%s)", r.stderr.strip())
        return False
    _ip("-n", namespace, "link", "del", "probe0", check=False)
    return True


def host_address(host_idx: int) -> str:
    return f"{SUBNET_PREFIX}.{host_idx // 250}.{host_idx % 250 + 1}"


def _ns_suffix(host: str, host_idx: int) -> str:
    return host if re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", host) else f"h{host_idx}"


class NetnsTestbed(Testbed):
    """Namespaces, a bridge and ``tc`` per host (module docstring); needs root."""

    backend = "netns"

    def __init__(self, topology: Topology, *, prefix: str, label: str = "topology") -> None:
        ok, why = netns_available()
        if not ok:
            raise TestbedError(f"cannot build a netns testbed: {why}")
        if len(topology) > 250 * 250:
            raise TestbedError(f"the netns backend handles at most {250 * 250} hosts, got {len(topology)}")
        super().__init__(topology, prefix=prefix, label=label)
        self.switch = f"{prefix}sw"
        self.namespaces = [f"{prefix}{_ns_suffix(h, k)}" for k, h in enumerate(self.hosts)]
        self._created: list[str] = []
        self._proxies: list[LinkProxy] = []
        self._delays: dict[tuple[int, int], LinkShaper] = {}
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        # Each namespace is recorded before it is made: an interrupt that lands while ``ip``
        # makes it must still leave it to close() (deleting one never made is a no-op).
        self._created.append(self.switch)
        _ip("netns", "add", self.switch)
        has_latency = any(v > 0 for row in self.topology.latency_s for v in row)
        netem = netem_available(self.switch)
        if netem or not has_latency:
            self.latency_mode = "netem" if netem else "none"
        elif tun_available(self.switch):
            self.latency_mode = "tun"
            logger.warning(
                "this kernel has no sch_netem: link latency is added by a TUN delay line per host (every packet)"
            )
        else:
            self.latency_mode = "userspace"
            logger.warning(
                "this kernel has no sch_netem and no TUN devices: link latency is added in user space on fusion's "
                "peer-mapped path only (gloo, ping and other raw traffic see bandwidth limits but no latency)"
            )
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for k, ns in enumerate(self.namespaces):
            self._created.append(ns)
            _ip("netns", "add", ns)
            _ip("-n", self.switch, "link", "add", f"h{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"h{k}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{host_address(k)}/16", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._shape(k, netem)
        if self.latency_mode == "tun":
            for k in range(len(self.hosts)):
                self._start_delay_line(k)
        self._write_peer_maps()

    def _delayed(self, i: int) -> dict[int, float]:
        """Destinations of host ``i`` whose link latency the ``tun`` delay line adds."""
        lat = self.topology.latency_s[i]
        return {j: lat[j] for j in range(len(self.hosts)) if j != i and lat[j] >= DIRECT_LATENCY_S}

    def _start_delay_line(self, i: int) -> None:
        """Route host ``i``'s delayed destinations through a TUN device and serve it
        (:mod:`testbeds.net.delayline`); what it hands back goes on through eth0 (table 100)."""
        delayed = self._delayed(i)
        if not delayed:
            return
        ns, me = self.namespaces[i], host_address(i)
        _ip("-n", ns, "tuntap", "add", "dev", DELAY_TUN, "mode", "tun")
        _ip("-n", ns, "link", "set", "dev", DELAY_TUN, "txqueuelen", "10000", "up")
        # Packets handed back carry this host's own source address: accept them (accept_local,
        # no reverse-path filter) and forward them.
        with in_netns(ns):
            for key, value in (
                ("ip_forward", "1"),
                ("conf/all/rp_filter", "0"),
                (f"conf/{DELAY_TUN}/rp_filter", "0"),
                (f"conf/{DELAY_TUN}/accept_local", "1"),
                ("conf/all/send_redirects", "0"),
            ):
                Path(f"/proc/sys/net/ipv4/{key}").write_text(value)
        log = self.workdir / f"delayline-{i}.log"
        argv = [sys.executable, "-m", "testbeds.net.delayline", "--tun", DELAY_TUN]
        for j, latency in delayed.items():
            argv += ["--delay", f"{host_address(j)}={latency!r}"]
        with open(log, "w") as f:
            proc = self.spawn(self.hosts[i], argv, stdout=f, stderr=subprocess.STDOUT)
        wait_for_line(log, r"ready", proc, 30)
        lines = [
            f"rule add iif {DELAY_TUN} lookup {DELAY_TABLE} pref 100",
            f"route add {SUBNET_PREFIX}.0.0/16 dev eth0 table {DELAY_TABLE}",
        ]
        lines += [f"route add {host_address(j)}/32 dev {DELAY_TUN} src {me}" for j in delayed]
        r = subprocess.run(
            ["ip", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n", check=False, capture_output=True, text=True
        )
        if r.returncode != 0:
            raise TestbedError(
                f"routing host {self.hosts[i]}'s delayed links through {DELAY_TUN} failed: {r.stderr.strip()}"
            )

    def _shape(self, i: int, netem: bool) -> None:
        """htb on host ``i``'s eth0: one class (and a netem leaf if available) per destination."""
        lines = ["qdisc add dev eth0 root handle 1: htb"]
        delayed = self._delayed(i) if self.latency_mode == "tun" else {}
        for j in range(len(self.hosts)):
            if j == i:
                continue
            rate_bytes_per_s = self.topology.bandwidth_bytes_per_s[i][j]
            rate_bit = int(rate_bytes_per_s * 8)
            burst = max(int(rate_bytes_per_s * BURST_S), MIN_BURST_BYTES)
            cls = f"{j + 16:x}"  # tc class and handle minors are hex
            lines.append(
                f"class add dev eth0 parent 1: classid 1:{cls} htb rate {rate_bit}bit ceil {rate_bit}bit "
                f"burst {burst} cburst {burst} quantum {QUANTUM_BYTES}"
            )
            if netem:
                latency_us = round(self.topology.latency_s[i][j] * 1e6)
                limit = max(1000, int(rate_bytes_per_s * (self.topology.latency_s[i][j] + 0.1) / 1500))
                lines.append(
                    f"qdisc add dev eth0 parent 1:{cls} handle {cls}: netem delay {latency_us}us limit {limit}"
                )
            elif j in delayed:
                rtt = self.topology.latency_s[i][j] + self.topology.latency_s[j][i]
                limit = max(100, int(rate_bytes_per_s * (DELAYED_QUEUE_RTTS * rtt + 0.05) / 1500))
                lines.append(f"qdisc add dev eth0 parent 1:{cls} handle {cls}: pfifo limit {limit}")
            lines.append(
                f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst {host_address(j)}/32 flowid 1:{cls}"
            )
        r = subprocess.run(
            ["tc", "-n", self.namespaces[i], "-batch", "-"],
            input="\n".join(lines) + "\n",
            check=False,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise TestbedError(f"tc shaping of host {self.hosts[i]} failed: {r.stderr.strip()}")

    def namespace(self, host: str) -> str:
        """The network namespace of ``host``."""
        return self.namespaces[self.index(host)]

    def address(self, host: str) -> str:
        return host_address(self.index(host))

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def shell_prefix(self, host: str) -> list[str]:
        return [*super().shell_prefix(host), "ip", "netns", "exec", self.namespace(host)]

    def peer_map_env(self, host: str) -> dict[str, str]:
        self.index(host)
        return {PEER_MAP_ENV: str(self.peer_map_path(host))} if self.latency_mode == "userspace" else {}

    def _socket(self, host: str) -> socket.socket:
        return netns_socket(self.namespace(host))

    def _route(self, src: str, dst: str, port: int) -> str:
        if self.latency_mode != "userspace" or self._proxy_not_needed(src, dst):
            return super()._route(src, dst, port)
        ns = self.namespace(src)
        fwd, bwd = self._delay(src, dst), self._delay(dst, src)
        proxy = LinkProxy(
            (self.address(src), 0),
            (self.address(dst), port),
            fwd,
            bwd,
            socket_factory=lambda: netns_socket(ns),
            name=f"{src}->{dst}:{port}",
        )
        self._proxies.append(proxy)
        return proxy.address

    def _proxy_not_needed(self, src: str, dst: str) -> bool:
        """A link under :data:`DIRECT_LATENCY_S` both ways goes direct (``htb`` alone): the
        Python hop would add about as much delay as the link has, and on a machine of few
        cores its copying competes with the workers for CPU (a 10 Gbps, 0.1 ms link
        carrying 4 MB per step cost the stages more than the link did)."""
        i, j = self.index(src), self.index(dst)
        return max(self.topology.latency_s[i][j], self.topology.latency_s[j][i]) < DIRECT_LATENCY_S

    def _delay(self, src: str, dst: str) -> LinkShaper:
        """The delay-only shaper of ``src -> dst`` (htb paces), shared by its proxies."""
        key = (self.index(src), self.index(dst))
        if key not in self._delays:
            self._delays[key] = LinkShaper(*self.link(src, dst), pace=False)
        return self._delays[key]

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """What each directed link's ``htb`` class sent: every frame, headers included, of all
        traffic (fusion's, the coordinator's, gloo's), whichever latency mode is in use."""
        carried: dict[tuple[str, str], int] = {}
        for i, ns in enumerate(self.namespaces):
            r = subprocess.run(
                ["tc", "-n", ns, "-s", "class", "show", "dev", "eth0"], check=False, capture_output=True, text=True
            )
            for m in _CLASS_SENT.finditer(r.stdout):
                j = int(m.group(1), 16) - 16  # class minors are destination index + 16 (_shape)
                if 0 <= j < len(self.hosts) and j != i:
                    carried[(self.hosts[i], self.hosts[j])] = int(m.group(2))
        return carried

    def _teardown_network(self) -> None:
        proxies, self._proxies = self._proxies, []
        for p in proxies:
            p.close()
        errors = []
        for ns in reversed(self._created):
            try:
                delete_namespace(ns)
            except TestbedError as e:
                errors.append(str(e))
        self._created.clear()
        if errors:
            raise TestbedError("; ".join(errors))
