"""Emulated WAN testbeds: one topology file, every host's processes, shaped links between them.

The one entry point is :func:`testbeds.net.backend.open_testbed`. It turns a topology (the TOML contract in
DESIGN.md, parsed by :mod:`scheduler.topology`) into a running testbed on this machine:

* ``netns`` (root, Linux): one network namespace per host joined by veth pairs to a bridge
  in a switch namespace; each host's egress is shaped per destination with ``tc`` ``htb``
  (:mod:`testbeds.net.netns`). Latency comes from ``netem`` where the kernel has ``sch_netem``;
  where it does not, from a user-space delay proxy on fusion's path.
* ``proxy`` (no root): every host gets its own loopback address ``127.0.X.Y`` and every
  directed host pair a user-space link proxy that paces bytes at the link's bandwidth and
  delays them by its latency (:mod:`testbeds.net.proxy`).

Fusion's own traffic reaches the emulated links through a *peer map*: a JSON file
``{"HOST:PORT": "PROXYHOST:PROXYPORT"}`` per source host, named by ``FUSION_PEER_MAP`` in the
environment of the processes started on that host; ``python -m testbeds.worker`` and
``python -m testbeds.coordinator`` dial the mapped address instead of the real one
(:mod:`testbeds.peer_map`). Call :meth:`Testbed.expose` with a
listening port *before* any process dials it, so that every host's map has the route.

Usage::

    with open_testbed("two-sites", backend="auto") as tb:
        port = tb.free_port("b-1")
        routes = tb.expose("b-1", port)        # {src host: address src dials for b-1:port}
        server = tb.spawn("b-1", [sys.executable, "-m", "my.server", f"{tb.address('b-1')}:{port}"])
        client = tb.spawn("a-1", [sys.executable, "-m", "my.client", f"{tb.address('b-1')}:{port}"])

Every process spawned through a testbed runs in its own process group, carries
``FUSION_TESTBED=<prefix>`` in its environment, and is killed (the whole group) by
:meth:`Testbed.close`; ``python -m testbeds down`` finds the leftovers of a testbed whose
owner died (SIGKILL) by that prefix.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from fusion.errors import ConfigError, FusionError
from scheduler.topology import Topology
from testbeds.peer_map import PEER_MAP_ENV as PEER_MAP_ENV  # where proxy and netns import it from

logger = logging.getLogger(__name__)

#: Environment variable that marks every process a testbed spawned (value: the prefix).
TESTBED_ENV = "FUSION_TESTBED"
#: Every name a testbed creates (namespaces, temp dirs, env marks) starts with ``fz<owner pid>``.
PREFIX_RE = re.compile(r"^fz(\d+)[a-z0-9]*-")
#: Shipped topology files, addressable by their stem (``two-sites``).
TOPOLOGY_DIR = Path(__file__).resolve().parents[1] / "topologies"
#: Seconds between SIGTERM and SIGKILL when a spawned process group is stopped.
STOP_GRACE_S = 3.0

BACKENDS = ("netns", "proxy")

_counter = 0
_counter_lock = threading.Lock()


class TestbedError(FusionError):
    """A testbed could not be built, used or torn down (missing privilege, tool or kernel feature)."""

    __test__ = False  # not a pytest test class, despite the name


def resolve_topology(topology: str | Path | Topology) -> tuple[Topology, str]:
    """A Topology and a label for it, from a Topology, a file path, or a shipped file's name."""
    if isinstance(topology, Topology):
        return topology, "topology"
    path = Path(topology)
    if not path.exists():
        shipped = TOPOLOGY_DIR / f"{path.name.removesuffix('.toml')}.toml"
        if not shipped.exists():
            names = ", ".join(sorted(p.stem for p in TOPOLOGY_DIR.glob("*.toml")))
            raise ConfigError(f"no topology file {str(topology)!r}: give a path or one of the shipped names ({names})")
        path = shipped
    return Topology.load(path), path.stem


def new_prefix() -> str:
    """A name prefix unique on this machine while this process lives: ``fz<pid>[n]-``."""
    global _counter
    with _counter_lock:
        n, _counter = _counter, _counter + 1
    return f"fz{os.getpid()}-" if n == 0 else f"fz{os.getpid()}n{n}-"


def owner_pid(name: str) -> int | None:
    """The pid of the process that created a testbed name, or None if it is not one."""
    m = PREFIX_RE.match(name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen, *, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process's group, SIGKILL it after ``grace_s``, and reap the process."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # The leader may be gone while group members live on (a shell's children): finish them.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Testbed:
    """A running emulated topology (use :func:`open_testbed`); a context manager.

    Attributes:
        backend: ``"netns"`` or ``"proxy"``.
        latency_mode: how latency is emulated: ``"netem"`` (kernel, every packet), ``"tun"``
            (a TUN delay line per host, every packet), ``"userspace"`` (a delay proxy on the
            peer-mapped fusion path only) or ``"none"``.
        hosts: host names in topology order.
        topology: the parsed topology.
        prefix: the unique name prefix of everything this testbed created.
        workdir: a private directory (peer maps, logs of callers that want one), removed on close.
    """

    __test__ = False  # not a pytest test class, despite the name

    backend: str = ""
    latency_mode: str = "none"

    def __init__(self, topology: Topology, *, prefix: str, label: str = "topology") -> None:
        if not PREFIX_RE.match(prefix):
            raise ConfigError(
                f"testbed prefix {prefix!r} must look like 'fz<pid>-' (so that 'python -m testbeds down' finds it)"
            )
        self.topology = topology
        self.label = label
        self.prefix = prefix
        self.hosts: list[str] = topology.names()
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self._exposed: dict[tuple[str, int], dict[str, str]] = {}
        self._peer_maps: dict[str, dict[str, str]] = {h: {} for h in self.hosts}
        atexit.register(self.close)

    # ----------------------------------------------------------------- topology facts
    def index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise ConfigError(f"no host {host!r} in this testbed; hosts: {', '.join(self.hosts)}") from None

    def link(self, src: str, dst: str) -> tuple[float, float]:
        """``(bandwidth_bytes_per_s, latency_s)`` configured for the directed link ``src -> dst``."""
        i, j = self.index(src), self.index(dst)
        return self.topology.bandwidth_bytes_per_s[i][j], self.topology.latency_s[i][j]

    def address(self, host: str) -> str:
        """The IP address other hosts use to reach ``host`` (and ``host``'s processes bind)."""
        raise NotImplementedError

    def describe(self) -> str:
        """A few lines: backend, latency mode, each host's address and how to run a command in it."""
        lines = [
            f"testbed {self.prefix.rstrip('-')} ({self.label}): backend {self.backend}, latency {self.latency_mode}"
        ]
        if self.backend == "netns" and self.latency_mode == "userspace":
            lines.append(
                "  (no sch_netem nor TUN in this kernel: latency is added only on fusion's peer-mapped path, "
                "by a user-space proxy)"
            )
        if self.latency_mode == "tun":
            lines.append(
                "  (no sch_netem in this kernel: a TUN delay line per host adds each link's latency to every packet)"
            )
        width = max(len(h) for h in self.hosts)
        for h in self.hosts:
            lines.append(
                f"  {h:<{width}}  {self.address(h):<15}  run: {' '.join(self.shell_prefix(h)) or '(this shell)'} CMD"
            )
        return "\n".join(lines)

    def shell_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command "on" ``host`` from a shell of this machine."""
        env = " ".join(f"{k}={v}" for k, v in self.peer_map_env(host).items())
        return ["env", env] if env else []

    # ----------------------------------------------------------------- processes
    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped so that it runs on ``host`` (inside its namespace for netns)."""
        self.index(host)
        return list(argv)

    def peer_map_env(self, host: str) -> dict[str, str]:
        """Environment fusion processes on ``host`` need (``FUSION_PEER_MAP`` where a map is used)."""
        self.index(host)
        return {}

    def spawn(
        self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None, **popen_kwargs: object
    ) -> subprocess.Popen:
        """Run ``argv`` on ``host`` in a new process group that :meth:`close` kills.

        ``env`` replaces the inherited environment (default: this process's); the testbed
        adds the host's :meth:`peer_map_env` and the ``FUSION_TESTBED`` mark either way.
        """
        if self._closed:
            raise TestbedError("this testbed is closed")
        full_env = dict(os.environ if env is None else env)
        full_env.update(self.peer_map_env(host))
        full_env[TESTBED_ENV] = self.prefix
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.exec_argv(host, argv), env=full_env, **popen_kwargs)  # type: ignore[call-overload]
        with self._lock:
            self._procs.append(proc)
        return proc

    def free_port(self, host: str) -> int:
        """A TCP port free a moment ago on ``host``'s address (for a server that must be
        exposed before it starts)."""
        with self._socket(host) as s:
            s.bind((self.address(host), 0))
            return int(s.getsockname()[1])

    def _socket(self, host: str) -> socket.socket:
        """A TCP socket that lives on ``host``'s network."""
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    # ----------------------------------------------------------------- routes
    def expose(self, host: str, port: int) -> dict[str, str]:
        """Register a server listening on ``address(host):port`` (e.g. a fusion executor).

        Makes the route from every other host to it (a link proxy where this backend or
        latency mode uses one) and adds it to every host's peer map. Returns, per source
        host, the ``HOST:PORT`` that source's processes must dial; fusion's processes started
        as ``testbeds.worker`` and ``testbeds.coordinator`` need not use it (they read the
        peer map), anything else must. Call it before a process dials the server: a gRPC
        channel made earlier stays direct.
        Idempotent.
        """
        self.index(host)
        key = (host, int(port))
        with self._lock:
            if key in self._exposed:
                return dict(self._exposed[key])
        target = f"{self.address(host)}:{port}"
        routes: dict[str, str] = {}
        for src in self.hosts:
            routes[src] = target if src == host else self._route(src, host, int(port))
        with self._lock:
            self._exposed[key] = routes
            for src, via in routes.items():
                if via != target:
                    self._peer_maps[src][target] = via
            self._write_peer_maps()
        return dict(routes)

    def _route(self, src: str, dst: str, port: int) -> str:
        """The address ``src`` dials to reach ``dst:port`` over the emulated link."""
        return f"{self.address(dst)}:{port}"

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes each directed link carried so far, as this backend counts them (its shaper's
        counter); empty where it cannot tell."""
        return {}

    def peer_map_path(self, host: str) -> Path:
        return self.workdir / f"peers-{self.index(host)}.json"

    def _write_peer_maps(self) -> None:
        for h, mapping in self._peer_maps.items():
            path = self.peer_map_path(h)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(mapping, indent=1, sort_keys=True))
            os.replace(tmp, path)  # atomic: a reader never sees half a file

    # ----------------------------------------------------------------- teardown
    def stop_processes(self) -> None:
        """Stop every process this testbed spawned (process groups; SIGTERM then SIGKILL)."""
        with self._lock:
            procs, self._procs = list(self._procs), []
        threads = [threading.Thread(target=stop_process_group, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(STOP_GRACE_S + 10.0)

    def _teardown_network(self) -> None:
        """Remove what the backend built (namespaces, proxies)."""

    def close(self) -> None:
        """Tear everything down: processes, then the emulated network, then the workdir."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for what, step in (("processes", self.stop_processes), ("network", self._teardown_network)):
            try:
                step()
            except Exception as e:  # keep tearing down; report all at the end
                logger.exception("testbed %s: stopping %s failed", self.prefix, what)
                errors.append(f"{what}: {e}")
        shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)
        if errors:
            raise TestbedError(
                f"testbed {self.prefix} teardown incomplete ({'; '.join(errors)}); run 'python -m testbeds down'"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def netns_available() -> tuple[bool, str]:
    """Whether the netns backend can run here, and if not, why."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "the netns backend needs root (use --backend proxy)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    r = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"'ip netns' does not work here: {r.stderr.strip()}"
    return True, ""


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match[str]:
    """Wait until the log file at ``path`` has a line matching ``pattern``; fail if ``proc`` exits."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        m = rx.search(text)
        if m:
            return m
        if proc.poll() is not None:
            raise TestbedError(
                f"{path.stem} exited with code {proc.returncode} before ready; its log ends with:\n{text[-2000:]}"
            )
        if time.monotonic() > deadline:
            raise TestbedError(f"{path.stem} not ready within {timeout_s:.0f}s; see {path}")
        time.sleep(0.05)
