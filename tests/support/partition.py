"""A link that can be cut and healed: a TCP relay on loopback that holds every byte while cut.

:class:`Relay` listens on a free loopback port and forwards each connection to ``target``.
While ``cut()`` is true nothing crosses, in either direction, on connections old or new:
the relay stops reading, so the senders' TCP windows fill and their calls stall until their
deadlines, as over a link that went down (a new connection is accepted by the kernel and
then hears nothing). When ``cut()`` turns false the held bytes flow again, late, as TCP
retransmits after a link comes back. Tests use it through
``python -m tests.support.partition_worker``; the product knows nothing of it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: How often a held pump looks whether the link is back.
POLL_S = 0.05
CHUNK_BYTES = 64 * 1024


class Relay:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``HOST:PORT``) while ``cut()`` is false."""

    def __init__(self, target: str, cut: Callable[[], bool]) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host.strip("[]") or "127.0.0.1", int(port))
        self.cut = cut
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"relay-{self.address}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _held(self) -> None:
        while self.cut() and not self._closed.is_set():
            time.sleep(POLL_S)

    def _connect(self, client: socket.socket) -> None:
        self._held()
        try:
            server = socket.create_connection(self.target, timeout=10)
            server.settimeout(None)
        except OSError as e:
            logger.info("relay %s: cannot reach %s: %s", self.address, self.target, e)
            client.close()
            return
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._held()
                data = src.recv(CHUNK_BYTES)
                if not data:
                    break
                self._held()
                dst.sendall(data)
        except OSError:
            pass  # the other side went away: close both ends below
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
