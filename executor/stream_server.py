"""The data plane's listener: a second port on each executor where peers send tensor frames
(:mod:`executor.frames`) over plain TCP, or TLS when the executor serves TLS, and the same
service on a Unix socket for peers on this machine (:mod:`executor.local_socket`).

One thread per connection reads frames one after another; each gets one answer
(:data:`REPLY`): ``ok`` with the payload bytes received, or an error with the code name a
gRPC call would have carried (:func:`executor.status.status_code_of`) and a message. A
frame refused before its payload was read (malformed, oversized, truncated, wrongly signed,
replayed, unexpected for the stage) leaves the stream at an unknown position, so the answer
is followed by closing the connection; the listener and every other connection keep
serving. A frame refused by the stage after it was read whole (a duplicate, a poisoned
tensor) is answered and the connection stays usable. Every refusal is logged with the
peer's address and the reason. Authentication failures count against the source address
(the executor's :class:`~fusion.auth.RateLimiter`), as they do for gRPC calls.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from executor import frames, local_socket
from executor.client import transfer_timeout_s
from executor.receive_buffers import ReceiveBuffers
from executor.socket_deadline import Deadline
from executor.status import POISONED_SENDER_METADATA, status_code_of
from executor.transport import Transfer
from fusion.auth import NonceCache, RateLimiter
from fusion.errors import AuthError, FusionError, PoisonedInputError, RateLimitError, WireError
from fusion.tls import ServerTls
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: The receiver's answer to a frame: magic b"FSNR" | status u8 (0 ok) | received bytes u64 |
#: error body bytes u32, then the body (JSON ``{"code", "message", "metadata"}``; data, never code).
REPLY = struct.Struct("<4sBQI")
REPLY_MAGIC = b"FSNR"
MAX_REPLY_BODY = 64 << 10
#: How long a connection may sit idle between frames before the listener closes it.
IDLE_TIMEOUT_S = 3600.0
#: Most bytes, and seconds, read and dropped after refusing a frame (:func:`_linger`).
LINGER_BYTES = 64 << 20
LINGER_S = 1.0
#: Most connections served at once; more are closed on accept.
MAX_CONNECTIONS = 256


class FrameSink(Protocol):
    """Where verified frames go (the executor's stages)."""

    def check(self, header: pb.TransferHeader) -> Any:
        """Validate a header against its stage before the payload is read; return a handle."""

    def deliver(self, handle: Any, header: pb.TransferHeader, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hand a complete, authenticated transfer to the stage ``check`` returned."""


class StageSink:
    """Delivers frames to the executor's stages with the checks of a gRPC ``Send``: the
    stage named must be loaded and expect this transfer (step, micro-batch, names, dtypes,
    shapes) before the payload is read; a complete transfer goes to its mailbox. A
    ``TRANSFER_KIND_PROBE`` frame of a job whose key this executor holds (a link
    measurement, at most ``max_probe_bytes``) is received and dropped."""

    def __init__(self, stage: Callable[[str, int], Any], *, max_probe_bytes: int) -> None:
        self.stage = stage
        self.max_probe_bytes = max_probe_bytes

    def check(self, header: pb.TransferHeader) -> Any:
        if header.kind == pb.TRANSFER_KIND_PROBE:
            size = sum(m.size_bytes for m in header.tensors)
            if size > self.max_probe_bytes:
                raise WireError(f"probe of {size} bytes is above the limit of {self.max_probe_bytes}")
            return None
        runtime = self.stage(header.job_id, header.stage_idx)
        runtime.check_transfer(header)
        return runtime

    def deliver(self, handle: Any, header: pb.TransferHeader, tensors: Mapping[str, torch.Tensor]) -> None:
        if handle is not None:
            handle.deliver(Transfer(header=header, payload=bytearray()), tensors)


def waitall(sock: socket.socket) -> int:
    """``MSG_WAITALL`` for a plain socket (one call fills the buffer), 0 for TLS (which takes no flags)."""
    return 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL


def recv_exact(sock: socket.socket, n: int, *, what: str) -> bytes:
    """Exactly ``n`` bytes; ``WireError`` naming ``what`` if the peer closes first."""
    data = sock.recv(n, waitall(sock))
    if len(data) == n:
        return data
    buf = bytearray(data)
    while len(buf) < n:
        more = sock.recv(n - len(buf))
        if not more:
            raise WireError(f"truncated frame: the connection closed after {len(buf)} of {n} bytes of the {what}")
        buf += more
    return bytes(buf)


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """A TLS server context from the executor's certificate chain and key (PEM)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="fusion-tls-") as d:
        cert, key = Path(d) / "cert.pem", Path(d) / "key.pem"
        cert.write_bytes(tls.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(tls.key_pem)
        ctx.load_cert_chain(cert, key)
    return ctx


def _linger(sock: socket.socket) -> None:
    """Read and drop what the peer still sends, briefly and boundedly, before the connection
    is closed: closing with unread data resets it, and the peer would lose the answer."""
    try:
        if isinstance(sock, ssl.SSLSocket):
            return  # a TLS close is orderly; nothing to drain
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(LINGER_S)
        scratch = bytearray(1 << 20)
        left = LINGER_BYTES
        while left > 0 and (n := sock.recv_into(scratch)):
            left -= n
    except OSError:
        pass


class DataListener:
    """Accepts data-plane connections on ``host`` (port 0: a free one) and serves frames.

    Args:
        host: address to listen on (the executor's gRPC host).
        keys: job id -> job key (the executor's keyring).
        nonces: the replay cache shared with the executor's gRPC access checks.
        sink: where verified transfers go.
        max_bytes: largest payload accepted per frame.
        tls: serve TLS with this certificate when given.
        failures: per-source budget of failed authentications.
        retired: job id -> its replaced keys, to name a frame of a replaced placement as stale.
        local_path: also serve peers on this machine over a Unix socket (where the platform
            has one; :mod:`executor.local_socket`).
    """

    def __init__(
        self,
        host: str,
        *,
        keys: frames.KeyLookup,
        nonces: NonceCache,
        sink: FrameSink,
        max_bytes: int,
        tls: ServerTls | None = None,
        failures: RateLimiter | None = None,
        retired: Callable[[str], list[bytes]] | None = None,
        local_path: bool = True,
    ) -> None:
        self.keys = keys
        self.retired = retired
        #: Memory tensors are received into, reused across frames.
        self.buffers = ReceiveBuffers()
        self.nonces = nonces
        self.sink = sink
        self.max_bytes = max_bytes
        self.failures = failures
        self._tls = server_context(tls) if tls is not None else None
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        #: The Unix socket co-located peers reach this listener on (``None``: TCP only).
        self.local = local_socket.listen(self._sock.getsockname()[0], self.port) if local_path else None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.num_refused = 0
        #: Warm-up frames read and discarded (:mod:`executor.stream_client`).
        self.num_warmups = 0
        #: Frames served whole, by path (``"tcp"``, ``"unix"``).
        self.num_frames: dict[str, int] = {"tcp": 0, "unix": 0}
        threading.Thread(target=self._accept, args=(self._sock,), name=f"data-plane-{self.port}", daemon=True).start()
        if self.local is not None:
            threading.Thread(
                target=self._accept, args=(self.local,), name=f"data-plane-local-{self.port}", daemon=True
            ).start()

    def _accept(self, listening: socket.socket) -> None:
        local = listening.family == getattr(socket, "AF_UNIX", None)
        while True:
            try:
                conn, addr = listening.accept()
            except OSError:
                if not self._closed:
                    logger.exception("data plane on port %d stopped accepting", self.port)
                return
            try:
                host = local_socket.accepted(conn) if local else str(addr[0])
            except OSError as e:
                logger.info("data plane: a connection closed on accept: %s", e)
                conn.close()
                continue
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    logger.warning("data plane: refusing %s, %d connections already open", host, MAX_CONNECTIONS)
                    conn.close()
                    continue
                self._conns.add(conn)
            path = "unix" if local else "tcp"
            threading.Thread(target=self._serve, args=(conn, host, path), name="data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, host: str, path: str) -> None:
        sock: socket.socket = conn
        try:
            if path == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(30.0)
            if self._tls is not None:
                sock = self._tls.wrap_socket(conn, server_side=True)
            deadline = Deadline(sock)
            deadline.set(transfer_timeout_s(0))
            seq = 1
            while self._frame(sock, deadline, host, seq, path):
                seq += 1
        except BlockingIOError:
            logger.info("data plane: connection from %s ended: timed out (no progress within a frame's bound)", host)
        except (OSError, ssl.SSLError) as e:
            logger.info("data plane: connection from %s ended: %s", host, e)
        except Exception:  # a bug: this connection ends, the listener keeps serving
            logger.exception("data plane: serving %s failed", host)
        finally:
            with self._lock:
                self._conns.discard(conn)
            sock.close()

    def _frame(self, sock: socket.socket, deadline: Deadline, host: str, seq: int, path: str) -> bool:
        """Serve one frame; whether the connection stays open for the next."""
        raw = _next_prefix(sock)
        if not raw:
            return False  # the peer closed between frames
        read_whole = False
        try:
            if len(raw) < frames.PREFIX.size:
                raw += recv_exact(sock, frames.PREFIX.size - len(raw), what="prefix")
            prefix = frames.parse_prefix(raw, max_payload_bytes=self.max_bytes)
            deadline.set(transfer_timeout_s(prefix.payload_len))
            rest = recv_exact(sock, prefix.job_len + prefix.header_len + frames.MAC_BYTES, what="header")
            try:
                head = frames.verify_head(
                    prefix, rest, raw, keys=self.keys, nonces=self.nonces, expected_seq=seq, retired=self.retired
                )
            except AuthError as e:
                if self.failures is not None and not self.failures.allow(host):
                    raise RateLimitError(f"too many failed authentications from {host} ({e})") from e
                raise
            if prefix.ftype == frames.TYPE_WARMUP:
                self._discard(sock, head)
                with self._lock:
                    self.num_warmups += 1
                sock.sendall(REPLY.pack(REPLY_MAGIC, 0, prefix.payload_len, 0))
                return True
            handle = self.sink.check(head.header)
            tensors = self._payload(sock, head)
            read_whole = True
            self.sink.deliver(handle, head.header, tensors)
        except FusionError as e:
            with self._lock:
                self.num_refused += 1
            code = status_code_of(e).name
            logger.warning("data plane: refused a frame from %s: %s: %s (%s)", host, type(e).__name__, e, code)
            metadata = {POISONED_SENDER_METADATA: str(e.sender_stage)} if isinstance(e, PoisonedInputError) else {}
            body = json.dumps({"code": code, "message": f"{type(e).__name__}: {e}", "metadata": metadata})
            sock.sendall(REPLY.pack(REPLY_MAGIC, 1, 0, len(body.encode())) + body.encode())
            if not read_whole:
                _linger(sock)
            return read_whole
        with self._lock:
            self.num_frames[path] += 1
        sock.sendall(REPLY.pack(REPLY_MAGIC, 0, prefix.payload_len, 0))
        return True

    def _payload(self, sock: socket.socket, head: frames.VerifiedHeader) -> dict[str, torch.Tensor]:
        """Receive the payload into preallocated tensors and check its tag."""
        from executor.compression import decode_tensor

        mac = frames.payload_mac(head.job_key, head.prefix.nonce)
        buffers = frames.receive_buffers(head.header, self.buffers)
        for _, _, view in buffers:
            _recv_into(sock, view, mac, head.payload_len)
        _check_tag(sock, mac)
        out: dict[str, torch.Tensor] = {}
        for meta, t, view in buffers:
            out[meta.name] = t if meta.codec in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED) else decode_tensor(meta, view)
        return out

    def _discard(self, sock: socket.socket, head: frames.VerifiedHeader) -> None:
        """Read a warm-up frame's payload into scratch memory and check its tag."""
        mac = frames.payload_mac(head.job_key, head.prefix.nonce)
        scratch = memoryview(bytearray(min(head.payload_len, frames.PIECE_BYTES)))
        left = head.payload_len
        while left:
            n = min(left, len(scratch))
            _recv_into(sock, scratch[:n], mac, head.payload_len)
            left -= n
        _check_tag(sock, mac)

    def close(self) -> None:
        """Stop accepting and close every open connection."""
        self._closed = True
        listening = [self._sock] + ([self.local] if self.local is not None else [])
        for s in listening:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            except OSError:
                pass
        try:
            for s in listening:
                s.close()  # an abstract Unix name is released with its socket
        finally:
            with self._lock:
                conns, self._conns = list(self._conns), set()
            for c in conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()


def _next_prefix(sock: socket.socket) -> bytes:
    """The next frame's prefix (or as much of it as came before the peer stopped), ``b""``
    if the peer closed between frames. The wait for it runs under the last frame's bound,
    renewed until the connection has been idle for :data:`IDLE_TIMEOUT_S`: a frame's bound
    is at least a minute, and not changing it per frame saves two syscalls a frame."""
    idle_since = time.monotonic()
    while True:
        try:
            return sock.recv(frames.PREFIX.size, waitall(sock))
        except (BlockingIOError, TimeoutError):
            if time.monotonic() - idle_since >= IDLE_TIMEOUT_S:
                raise


def _recv_into(sock: socket.socket, view: memoryview, mac: Poly1305, payload_len: int) -> None:
    """Fill ``view`` from ``sock`` in pieces of at most :data:`frames.PIECE_BYTES`, feeding
    each to the payload ``mac``; ``WireError`` if the peer closes first."""
    got = 0
    flags = waitall(sock)
    while got < len(view):
        k = sock.recv_into(view[got:], min(frames.RECV_PIECE_BYTES, len(view) - got), flags)
        if k == 0:
            raise WireError(f"truncated frame: the connection closed inside a payload of {payload_len}")
        mac.update(view[got : got + k])
        got += k


def _check_tag(sock: socket.socket, mac: Poly1305) -> None:
    """Read the payload tag and verify it; ``AuthError`` if it does not match."""
    tag = recv_exact(sock, frames.TAG_BYTES, what="payload tag")
    try:
        mac.verify(tag)
    except InvalidSignature:
        raise AuthError("frame payload does not match its tag: altered in transit or signed with another key") from None
