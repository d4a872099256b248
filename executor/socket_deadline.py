"""Deadlines on data-plane sockets without Python's socket timeouts.

A Python socket with a timeout is non-blocking underneath: each ``recv``, ``send`` and
``sendmsg`` first polls the socket, then makes the call, and ``settimeout`` itself is one
more syscall (it flips the descriptor's blocking mode). On the data plane, where a frame is a
handful of calls, that doubles the syscalls per frame. :class:`Deadline` keeps a plain socket
blocking and bounds each call in the kernel instead (``SO_RCVTIMEO``/``SO_SNDTIMEO``, set only
when the bound changes): a call that makes no progress for that long fails with ``EAGAIN``,
which :func:`timed_out` turns into the ``TimeoutError`` a Python timeout would have raised.
As with Python's timeouts, the bound is per call, not per frame: a peer that keeps sending,
however slowly, is not cut off.

A TLS socket keeps Python's timeout (:mod:`ssl` needs a socket's own timeout to report a
stalled read or write).
"""

from __future__ import annotations

import socket
import ssl
import struct

_TIMEVAL = struct.Struct("@ll")


class Deadline:
    """The per-call time bound of one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.kernel = not isinstance(sock, ssl.SSLSocket) and hasattr(socket, "SO_RCVTIMEO")
        self.seconds: float | None = None
        if self.kernel:
            sock.settimeout(None)

    def set(self, seconds: float) -> None:
        """Bound each later call on the socket to ``seconds`` without progress."""
        if seconds == self.seconds:
            return
        self.seconds = seconds
        if not self.kernel:
            self.sock.settimeout(seconds)
            return
        whole = int(seconds)
        tv = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def timed_out(deadline: Deadline) -> TimeoutError:
    """The ``TimeoutError`` for a call the kernel stopped at ``deadline``."""
    return TimeoutError(f"timed out: no progress for {deadline.seconds:g} s")
