"""The sending side of the data plane: connections to peers' data ports and the frames sent
over them (:mod:`executor.frames`, answered as :mod:`executor.stream_server` describes).

A peer advertises its data port in every answer to a gRPC ``Send``
(``SendResponse.data_port``), so the first transfer to a peer goes over gRPC and the next
ones over a direct connection to the same host; a peer that advertises none (an older
release, or one running without the data plane) keeps getting gRPC. Connections are kept
per peer and reused, one transfer at a time each; paced senders with several transfers in
flight (:mod:`executor.sender`) open one per transfer in flight.

Failures keep the gRPC path's contract. A peer whose data port cannot be reached (behind
NAT, a firewall) is not tried on that port again, and that send goes over gRPC (which
retries, then fails as the driver expects); a connection that breaks during a transfer
fails the send with :class:`~fusion.errors.RemoteError` ``UNAVAILABLE``, and a refusal
comes back as a ``RemoteError`` with the code and message the gRPC call would have
carried. The connection is dropped after either. With TLS (a CA set for the pool or the
process) connections are TLS, verified against that CA and the peer's host name.

A new TCP connection to a peer whose link bandwidth is known (a paced destination,
:mod:`executor.sender`) first carries one warm-up frame (:data:`frames.TYPE_WARMUP`) of
:data:`WARMUP_BDPS` bandwidth-delay products, the round trip being what the connect took
(at most :data:`frames.MAX_WARMUP_BYTES`; none under :data:`MIN_WARMUP_BYTES`). Congestion
control learns a connection's sending rate from what the connection delivers, and one that
only ever carries transfers shorter than the link's bandwidth-delay product never shows it
the link: BBR (the default congestion control of many Linux hosts) then keeps pacing every
transfer at the rate of the connection's first short bursts, each arriving up to a round
trip late. One burst of a few bandwidth-delay products lets it measure the link, and the
connection's transfers then take their latency plus their bytes at the link's rate, as the
planner prices them (measured: docs/benchmarks.md). A peer that refuses warm-ups (an older
release) gets none after the first refusal.

A peer on this machine is reached over its Unix socket (:mod:`executor.local_socket`) with
the same frames, and over TCP when it has none; not when connections are opened through a
custom :data:`ConnectionFactory`, which would be bypassed.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from executor import frames, local_socket
from executor.client import transfer_timeout_s
from executor.socket_deadline import Deadline, timed_out
from executor.stream_server import MAX_REPLY_BODY, REPLY, REPLY_MAGIC, recv_exact
from executor.transport import payload_views, scalar_to_wire
from fusion.auth import KeyRing
from fusion.errors import RemoteError, WireError
from fusion.tls import client_ca
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Opens a data connection: ``(host, port) -> connected socket``. The seam a testbed uses to
#: route data connections the way its channel factory routes gRPC (:mod:`executor.hooks`).
ConnectionFactory = Callable[[str, int], socket.socket]

#: Seconds to wait for a data connection to open before falling back to gRPC (once per
#: peer and port: an unreachable port is not tried again).
CONNECT_TIMEOUT_S = 5.0
#: Most buffers handed to one ``sendmsg`` (Linux's ``UIO_MAXIOV``).
_IOV_MAX = 1024
#: Over TLS, a batch up to this size is joined into one write (one record, one syscall).
_TLS_JOIN_BYTES = 256 << 10
#: A new connection's warm-up, in bandwidth-delay products of its link (module docstring):
#: a BBR sender's rate doubles each round trip of its start-up, and about two
#: bandwidth-delay products have left by the time it reaches the link's rate.
WARMUP_BDPS = 3.0
#: No warm-up below this: a connection's initial window and start-up cover it.
MIN_WARMUP_BYTES = 64 << 10


def warmup_bytes(bandwidth_bytes_per_s: float, round_trip_s: float) -> int:
    """Bytes of the warm-up frame for a link of this bandwidth and round trip (0: none)."""
    size = WARMUP_BDPS * bandwidth_bytes_per_s * round_trip_s
    return 0 if size < MIN_WARMUP_BYTES else min(int(size), frames.MAX_WARMUP_BYTES)


def default_connection(host: str, port: int) -> socket.socket:
    """A plain TCP connection to ``host:port``."""
    return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)


class _Conn:
    """One open data connection, its path (``"tcp"``, ``"unix"``) and its next frame's
    sequence number."""

    def __init__(self, sock: socket.socket, path: str, round_trip_s: float = 0.0) -> None:
        self.sock = sock
        self.deadline = Deadline(sock)
        self.path = path
        self.seq = 1
        #: What opening the TCP connection took: about one round trip (0 for a Unix socket).
        self.round_trip_s = round_trip_s


def send_buffers(sock: socket.socket, buffers: list[memoryview | bytes]) -> None:
    """Send ``buffers`` in order without joining them: one gathering ``sendmsg`` per call the
    kernel takes, resumed where a partial send stopped. A TLS socket has no ``sendmsg``:
    there small buffers are joined (one TLS record) and large ones sent one by one."""
    if isinstance(sock, ssl.SSLSocket):
        if sum(len(b) for b in buffers) <= _TLS_JOIN_BYTES:
            sock.sendall(b"".join(buffers))
            return
        for b in buffers:
            sock.sendall(b)
        return
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        while sent:
            if sent >= len(pending[0]):
                sent -= len(pending.pop(0))
            else:
                pending[0] = pending[0][sent:]
                sent = 0


class DataPlaneClient:
    """Direct tensor sends to peers that advertise a data port.

    Args:
        keyring: the job keys frames are signed with.
        tls_ca: CA to verify peers with (default: the process's; none: plain TCP).
        connect: how a connection is opened (:data:`ConnectionFactory`).
        ports: peer address -> data port, shared with whoever learns them
            (:attr:`executor.client.ChannelPool.data_ports`).
        local_path: reach peers on this machine over their Unix socket (default: unless
            ``connect`` is given).
        warmup: send a new TCP connection's warm-up frame where the link's bandwidth is
            given (module docstring).
    """

    def __init__(
        self,
        keyring: KeyRing,
        *,
        tls_ca: bytes | None = None,
        connect: ConnectionFactory | None = None,
        ports: dict[str, int] | None = None,
        local_path: bool | None = None,
        warmup: bool = True,
    ) -> None:
        self.keyring = keyring
        self.warmup = warmup
        self.tls_ca = tls_ca
        self.local_path = connect is None if local_path is None else local_path
        self.connect = connect or default_connection
        #: Frames sent and answered, by path (``"tcp"``, ``"unix"``).
        self.num_frames: dict[str, int] = {"tcp": 0, "unix": 0}
        self._ports: dict[str, int] = ports if ports is not None else {}
        #: (address, port) pairs that could not be reached: a peer behind NAT or a firewall
        #: advertises a port nobody can dial, and keeps advertising it in every answer.
        self._unreachable: set[tuple[str, int]] = set()
        #: Peers that refused a warm-up frame.
        self._no_warmup: set[str] = set()
        #: Warm-up frames sent and answered.
        self.num_warmups = 0
        self._idle: dict[str, list[_Conn]] = {}
        self._lock = threading.Lock()

    def learn(self, address: str, port: int) -> None:
        """Record the data port a peer advertised (0: it has none)."""
        with self._lock:
            if port:
                self._ports[address] = port
            else:
                self._ports.pop(address, None)

    def port(self, address: str) -> int | None:
        """The data port to use for ``address``; ``None``: use gRPC."""
        with self._lock:
            port = self._ports.get(address)
            return None if port is None or (address, port) in self._unreachable else port

    def forget(self, address: str) -> None:
        """Stop using the data plane to ``address`` and close its idle connections."""
        with self._lock:
            self._ports.pop(address, None)
            conns = self._idle.pop(address, [])
        for c in conns:
            c.sock.close()

    def _open(self, address: str, port: int) -> _Conn:
        host = address.rpartition(":")[0].strip("[]")
        sock = local_socket.connect(host, port, timeout_s=CONNECT_TIMEOUT_S) if self.local_path else None
        path = "unix" if sock is not None else "tcp"
        round_trip_s = 0.0
        if sock is None:
            t0 = time.perf_counter()
            sock = self.connect(host, port)
            round_trip_s = time.perf_counter() - t0
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ca = self.tls_ca if self.tls_ca is not None else client_ca()
        if ca is not None:
            ctx = ssl.create_default_context(cadata=ca.decode())
            sock = ctx.wrap_socket(sock, server_hostname=host)
        return _Conn(sock, path, round_trip_s)

    def send(
        self,
        address: str,
        header: pb.TransferHeader,
        tensors: Mapping[str, torch.Tensor],
        scalars: Mapping[str, Any] | None = None,
        *,
        encoded: Mapping[str, tuple[pb.TensorMeta, bytes]] | None = None,
        link_bytes_per_s: float | None = None,
    ) -> int | None:
        """Send one transfer over the data plane; payload bytes, or ``None`` when this peer
        must be reached over gRPC (no data port known, no job key, or no connection).
        ``link_bytes_per_s``: the link's measured bandwidth, which sizes a new connection's
        warm-up (module docstring)."""
        port = self.port(address)
        key = self.keyring.job(header.job_id)
        if port is None or key is None:
            return None
        with self._lock:
            idle = self._idle.get(address)
            conn = idle.pop() if idle else None
        reused = conn is not None
        if conn is None and (conn := self._try_open(address, port, key, header.job_id, link_bytes_per_s)) is None:
            return None
        for name, value in (scalars or {}).items():
            header.values.append(scalar_to_wire(name, value))
        views = payload_views(header, tensors, encoded)
        size = sum(len(v) for v in views)
        what = f"Send(kind {header.kind} to stage {header.stage_idx}, micro-batch {header.micro_batch_idx})"
        while True:
            try:
                received = self._exchange(conn, key, header, views, size)
                break
            except (OSError, ssl.SSLError, WireError) as e:
                if isinstance(e, BlockingIOError):
                    e = timed_out(conn.deadline)
                conn.sock.close()
                # A kept connection may have died while idle (the peer restarted): one more
                # try on a fresh one, as a gRPC call retries UNAVAILABLE.
                if reused and (conn := self._try_open(address, port, key, header.job_id, link_bytes_per_s)) is not None:
                    reused = False
                    continue
                raise RemoteError(
                    f"{what} on {address} failed with UNAVAILABLE: data connection lost ({e})",
                    code="UNAVAILABLE",
                    peer=address,
                ) from None
            except RemoteError as e:
                conn.sock.close()
                message = f"{what} on {address} failed with {e.code}: {e}"
                raise RemoteError(message, code=e.code, peer=address, metadata=e.metadata) from None
        with self._lock:
            self.num_frames[conn.path] += 1
            self._idle.setdefault(address, []).append(conn)
        return received

    def _try_open(
        self, address: str, port: int, key: bytes, job_id: str, link_bytes_per_s: float | None
    ) -> _Conn | None:
        """A new connection, warmed up where the link's bandwidth is known; ``None`` (and the
        peer forgotten) if it cannot be opened."""
        try:
            conn = self._open(address, port)
        except (OSError, ssl.SSLError) as e:
            logger.warning("data plane to %s port %d unreachable (%s); sending over gRPC", address, port, e)
            with self._lock:
                self._unreachable.add((address, port))
            self.forget(address)
            return None
        size = warmup_bytes(link_bytes_per_s or 0.0, conn.round_trip_s) if conn.path == "tcp" else 0
        if not self.warmup or not size or address in self._no_warmup:
            return conn
        try:
            self._exchange(conn, key, pb.TransferHeader(job_id=job_id), [memoryview(bytes(size))], size, warmup=True)
        except (OSError, ssl.SSLError, WireError, RemoteError) as e:
            conn.sock.close()
            logger.info("data plane: %s refused a warm-up (%s); its connections get none", address, e)
            with self._lock:
                self._no_warmup.add(address)
            return self._try_open(address, port, key, job_id, link_bytes_per_s)
        with self._lock:
            self.num_warmups += 1
        return conn

    @staticmethod
    def _exchange(
        conn: _Conn,
        key: bytes,
        header: pb.TransferHeader,
        views: list[memoryview],
        size: int,
        *,
        warmup: bool = False,
    ) -> int:
        sock = conn.sock
        conn.deadline.set(transfer_timeout_s(size))
        ftype = frames.TYPE_WARMUP if warmup else frames.TYPE_TRANSFER
        head, nonce = frames.encode_head(key, header, size, conn.seq, ftype=ftype)
        conn.seq += 1
        mac = frames.payload_mac(key, nonce)
        # Each piece is MAC'd just before it is sent (still in cache), and pieces go out in
        # batches of about PIECE_BYTES with one gathering send: a small frame is one
        # syscall, header and tag included, and no payload byte is copied in user space.
        batch: list[memoryview | bytes] = [head]
        batch_bytes = 0
        for piece in frames.payload_pieces(views):
            mac.update(piece)
            batch.append(piece)
            batch_bytes += len(piece)
            if batch_bytes >= frames.PIECE_BYTES:
                send_buffers(sock, batch)
                batch, batch_bytes = [], 0
        batch.append(mac.finalize())
        send_buffers(sock, batch)
        magic, status, received, body_len = REPLY.unpack(recv_exact(sock, REPLY.size, what="answer"))
        if magic != REPLY_MAGIC or body_len > MAX_REPLY_BODY:
            raise WireError("malformed answer from the data plane")
        if status == 0:
            return int(received)
        try:
            body = json.loads(recv_exact(sock, body_len, what="answer"))
            code, message, metadata = str(body["code"]), str(body["message"]), dict(body.get("metadata") or {})
        except (ValueError, KeyError, TypeError) as e:
            raise WireError(f"malformed error answer from the data plane: {e}") from e
        raise RemoteError(message, code=code, metadata={str(k): str(v) for k, v in metadata.items()})

    def close(self) -> None:
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.sock.close()
