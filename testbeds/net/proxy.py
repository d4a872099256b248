"""A user-space link proxy: TCP bytes paced at a link's bandwidth and delayed by its latency.

The ``proxy`` backend (no root) gives every host a loopback address ``127.0.X.Y`` and, for
each server :meth:`~testbeds.net.testbed.Testbed.expose`-d on host B, one listener per source host
A bound on A's address: what A's processes send through it reaches B as the link A -> B
would carry it, and B's answers come back as B -> A would. The netns backend reuses the
same proxy with no bandwidth limit (``tc`` shapes) to add latency where the kernel lacks
``sch_netem``.

The link model, per direction: a byte read at time ``t`` leaves the link's serialiser at
``d = max(t, free) + size / bandwidth`` (``free`` is when the link finished its previous
chunk; all connections over one directed link share it, as they share a real link) and
is delivered at ``d + latency``. The proxy holds at most about one bandwidth-delay product
(plus a little) per connection and direction, so TCP flow control pushes back on the
sender as a real bottleneck would and a sender cannot "finish" long before its receiver.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable

from scheduler.topology import Topology
from testbeds.net.testbed import PEER_MAP_ENV, Testbed, TestbedError

logger = logging.getLogger(__name__)

#: Largest chunk moved at once (bytes): large chunks keep the proxy cheap at 1 Gbps.
MAX_CHUNK_BYTES = 256 * 1024
#: Smallest chunk (bytes): about one Ethernet frame.
MIN_CHUNK_BYTES = 1500
#: A chunk carries at most this much link time (s), so slow links are paced smoothly.
CHUNK_TIME_S = 0.002
#: Queue allowance beyond the bandwidth-delay product (s of link time).
QUEUE_SLACK_S = 0.05
#: Queue bound for a direction without a bandwidth limit (bytes).
UNSHAPED_QUEUE_BYTES = 8 * 1024 * 1024

SocketFactory = Callable[[], socket.socket]


class LinkShaper:
    """One direction of one emulated link (shared by every connection that crosses it)."""

    def __init__(self, bandwidth_bytes_per_s: float | None, latency_s: float, *, pace: bool = True) -> None:
        """``pace=False`` only delays (another shaper, such as ``tc``, limits the rate); the
        bandwidth then still bounds the queue, so the proxy buffers no more than the link would."""
        if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
            raise TestbedError(f"link bandwidth must be positive, got {bandwidth_bytes_per_s} bytes/s")
        if latency_s < 0:
            raise TestbedError(f"link latency must be >= 0, got {latency_s} s")
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s if pace else None
        self.latency_s = latency_s
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes_total = 0
        """Bytes carried so far (all connections): proof that traffic took this link."""
        if bandwidth_bytes_per_s is None:
            self.chunk_bytes = MAX_CHUNK_BYTES
            self.queue_bytes = UNSHAPED_QUEUE_BYTES
        else:
            self.chunk_bytes = int(min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, bandwidth_bytes_per_s * CHUNK_TIME_S)))
            self.queue_bytes = int(bandwidth_bytes_per_s * (latency_s + QUEUE_SLACK_S)) + 2 * self.chunk_bytes

    def delivery_time(self, size_bytes: int) -> float:
        """When ``size_bytes`` read now reach the other end (``time.monotonic`` clock)."""
        now = time.monotonic()
        with self._lock:
            self.bytes_total += size_bytes
            if self.bandwidth_bytes_per_s is None:
                return now + self.latency_s
            self._free_at = max(now, self._free_at) + size_bytes / self.bandwidth_bytes_per_s
            return self._free_at + self.latency_s


class _Pump:
    """Moves one direction of one connection: a reader stamps chunks, a writer delivers them on time."""

    def __init__(
        self,
        src: socket.socket,
        dst: socket.socket,
        shaper: LinkShaper,
        on_close: Callable[[], None],
        on_done: Callable[[], None],
        name: str,
    ) -> None:
        self.src, self.dst, self.shaper, self.on_close, self.on_done = src, dst, shaper, on_close, on_done
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._dead = False
        self.threads = [
            threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
            threading.Thread(target=self._write, name=f"{name}-write", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def kill(self) -> None:
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                with self._cond:  # room first: a chunk is on the link from the moment it is read
                    while self._queued_bytes > self.shaper.queue_bytes and not self._dead:
                        self._cond.wait()
                    if self._dead:
                        return
                data = self.src.recv(self.shaper.chunk_bytes)
                due = self.shaper.delivery_time(len(data)) if data else time.monotonic() + self.shaper.latency_s
                with self._cond:
                    self._queue.append((due, data))
                    self._queued_bytes += len(data)
                    self._cond.notify_all()
                if not data:  # EOF travels the link too (after the data before it)
                    return
        except OSError:
            self.on_close()

    def _write(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._dead:
                        self._cond.wait()
                    if self._dead:
                        return
                    due, data = self._queue[0]
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                with self._cond:
                    self._queue.popleft()
                    self._queued_bytes -= len(data)
                    self._cond.notify_all()
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    self.on_done()
                    return
                self.dst.sendall(data)
        except OSError:
            self.on_close()


class LinkProxy:
    """A TCP listener whose connections are forwarded to ``target`` through two shapers.

    Args:
        listen: ``(host, port)`` to listen on (port 0 picks one; see :attr:`address`).
        target: ``(host, port)`` every accepted connection is forwarded to.
        forward: the shaper for bytes from the listener's clients to ``target``.
        backward: the shaper for the answers.
        socket_factory: makes the listening and the outgoing sockets (the netns backend
            makes them inside the source host's namespace).
    """

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        forward: LinkShaper,
        backward: LinkShaper,
        *,
        socket_factory: SocketFactory | None = None,
        name: str = "link",
    ) -> None:
        self.target = target
        self.forward, self.backward = forward, backward
        self.name = name
        self._factory = socket_factory or (lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        self._listener = self._factory()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(listen)
        self._listener.listen(64)
        self.address = f"{listen[0]}:{self._listener.getsockname()[1]}"
        self._conns: list[tuple[socket.socket, socket.socket, _Pump, _Pump]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._num_accepted = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                self._connect(client)
            except OSError as e:
                logger.info("%s: cannot reach %s:%d (%s); dropping the connection", self.name, *self.target, e)
                client.close()
            except Exception:
                logger.exception("%s: forwarding a connection failed", self.name)
                client.close()

    def _connect(self, client: socket.socket) -> None:
        upstream = self._factory()
        try:
            upstream.settimeout(10.0)
            upstream.connect(self.target)
            upstream.settimeout(None)
        except OSError:
            upstream.close()
            raise
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the proxy paces; Nagle would only add delay
        with self._lock:
            n = self._num_accepted = self._num_accepted + 1
        pumps: list[_Pump] = []
        finished: list[int] = []
        conn: list[object] = []

        def close_both() -> None:
            for p in pumps:
                p.kill()
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self._lock:
                if conn and conn[0] in self._conns:
                    self._conns.remove(conn[0])  # type: ignore[arg-type]

        def one_done() -> None:  # both directions saw EOF: the connection is over
            with self._lock:
                finished.append(1)
                last = len(finished) == 2
            if last:
                close_both()

        pumps.append(_Pump(client, upstream, self.forward, close_both, one_done, f"{self.name}-{n}-fwd"))
        pumps.append(_Pump(upstream, client, self.backward, close_both, one_done, f"{self.name}-{n}-bwd"))
        entry = (client, upstream, pumps[0], pumps[1])
        conn.append(entry)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._conns.append(entry)
        if closed:
            close_both()
            return
        for p in pumps:
            p.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for client, upstream, fwd, bwd in conns:
            fwd.kill()
            bwd.kill()
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._thread.join(5.0)


def loopback_address(host_idx: int) -> str:
    """``127.0.X.Y`` for the host at ``host_idx`` (X from 10, Y from 1; 250 hosts per X)."""
    return f"127.0.{10 + host_idx // 250}.{1 + host_idx % 250}"


class ProxyTestbed(Testbed):
    """The topology on loopback: per-host addresses, a link proxy per (source, exposed server)."""

    backend = "proxy"
    latency_mode = "userspace"

    def __init__(self, topology: Topology, *, prefix: str, label: str = "topology") -> None:
        super().__init__(topology, prefix=prefix, label=label)
        n = len(self.hosts)
        if n > 250 * 240:
            raise TestbedError(f"the proxy backend handles at most {250 * 240} hosts, got {n}")
        self._addresses = [loopback_address(i) for i in range(n)]
        self._shapers: dict[tuple[int, int], LinkShaper] = {}
        for i in range(n):
            for j in range(n):
                if i != j:
                    self._shapers[(i, j)] = LinkShaper(topology.bandwidth_bytes_per_s[i][j], topology.latency_s[i][j])
        self._proxies: list[LinkProxy] = []
        self._write_peer_maps()

    def address(self, host: str) -> str:
        return self._addresses[self.index(host)]

    def shaper(self, src: str, dst: str) -> LinkShaper:
        """The shared state of the directed link ``src -> dst``."""
        return self._shapers[(self.index(src), self.index(dst))]

    def link_bytes(self) -> dict[tuple[str, str], int]:
        return {(self.hosts[i], self.hosts[j]): sh.bytes_total for (i, j), sh in self._shapers.items()}

    def peer_map_env(self, host: str) -> dict[str, str]:
        return {PEER_MAP_ENV: str(self.peer_map_path(host))}

    def _route(self, src: str, dst: str, port: int) -> str:
        proxy = LinkProxy(
            (self.address(src), 0),
            (self.address(dst), port),
            self.shaper(src, dst),
            self.shaper(dst, src),
            name=f"{src}->{dst}:{port}",
        )
        self._proxies.append(proxy)
        return proxy.address

    def _teardown_network(self) -> None:
        proxies, self._proxies = self._proxies, []
        for p in proxies:
            p.close()
