"""The data plane's local path: executors on one machine exchange frames over a Unix stream
socket instead of loopback TCP, with the same framing, authentication and (when the
executor serves TLS) TLS as :mod:`executor.stream_server` uses on its TCP port.

A Unix socket skips the TCP/IP stack (segmentation, checksums, acknowledgements, the
loopback device), so a co-located pair of stages moves tensors with less CPU per byte.

Where the socket lives: Linux's abstract namespace, under a name derived from the data
listener's bound TCP address, ``fusion-data/<ip>/<port>``. An abstract name has no file to
clean up (it disappears with the socket, even when the process is killed) and, like a TCP
port, it is scoped to the network namespace, so executors in different namespaces (hosts
that share one kernel, such as containers) never see each other's local path. Since a TCP address is unique
within a namespace, so is the name; a peer's name is found from the address the sender
already knows (the gRPC host and the advertised data port), so nothing new crosses the wire.

Who may use it: any process of the namespace can connect to an abstract name, exactly as
any can connect to a loopback port, so every frame is still authenticated with the job key.
Any process can also *bind* a name first; a sender therefore uses a local socket only if its
listener runs under the sender's own user id (``SO_PEERCRED``), and otherwise dials TCP. On
other platforms, or when the name cannot be bound or reached, TCP is used.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import sys

import psutil

logger = logging.getLogger(__name__)

#: Send and receive buffer requested for local connections: a Unix socket's default (about
#: 200 KiB) makes a large transfer stall on every buffer's worth; the kernel caps the
#: request at ``net.core.wmem_max`` / ``rmem_max``.
LOCAL_BUFFER_BYTES = 4 << 20
_WILDCARDS = ("0.0.0.0", "::")
_UCRED = struct.Struct("3i")  # pid, uid, gid


def supported() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def _normal(host: str) -> str:
    host = host.strip("[]")
    if host == "localhost":
        return "127.0.0.1"
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def local_name(host: str, port: int) -> str:
    """The abstract socket name of the data listener bound to ``host:port``."""
    return f"\0fusion-data/{_normal(host)}/{port}"


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (in this network namespace)."""
    host = _normal(host)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    # The interfaces' own list, not a trial bind: with ``ip_nonlocal_bind`` any address binds.
    return any(
        a.family in (socket.AF_INET, socket.AF_INET6) and _normal(a.address) == host
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
    )


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, LOCAL_BUFFER_BYTES)


def listen(host: str, port: int, *, backlog: int = 64) -> socket.socket | None:
    """A listening Unix socket for the data listener bound to ``host:port``; ``None`` when the
    platform has none or the name is taken (logged: the listener then serves TCP only)."""
    if not supported():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(local_name(host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        logger.warning("data plane: no local path for %s:%d (%s); co-located peers use TCP", host, port, e)
        return None
    return sock


def accepted(conn: socket.socket) -> str:
    """Tune an accepted local connection; a label for its peer, by user id (the source that
    logs name and failed authentications count against, as an IP address is for TCP)."""
    _tune(conn)
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return f"local uid {uid}"


def connect(host: str, port: int, *, timeout_s: float) -> socket.socket | None:
    """A local connection to the data listener that ``host:port`` names, or ``None`` when
    there is none on this machine (or its owner is another user): dial TCP then."""
    if not supported():
        return None
    names = [local_name(host, port)]
    if is_local_address(host):  # a listener bound to every address also serves this one
        names += [local_name(w, port) for w in _WILDCARDS]
    for name in names:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(name)
            _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if uid != os.getuid():
                logger.warning(
                    "data plane: the local socket for %s:%d belongs to uid %d, not this user; using TCP",
                    host,
                    port,
                    uid,
                )
                sock.close()
                return None
            _tune(sock)
            return sock
        except OSError:
            sock.close()
    return None
