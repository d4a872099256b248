"""Route fusion's gRPC traffic over a testbed's emulated links: the peer map.

A testbed whose links are user-space proxies (:mod:`testbeds.net.proxy`, or netns without
``sch_netem``) writes, per source host, a JSON file ``{"HOST:PORT": "PROXYHOST:PROXYPORT"}``
naming the proxy that carries that host's traffic to each server (:meth:`testbeds.net.Testbed.expose`),
and names it in the environment of the processes it starts there (:data:`PEER_MAP_ENV`).
:func:`peer_map_channels` turns the file into a channel factory for the executor's seam
(:data:`executor.hooks.ChannelFactory`): a channel to a mapped address dials the proxy,
which forwards to the real one. The product knows nothing of it; ``python -m
testbeds.worker`` and ``python -m testbeds.coordinator`` install it (``--peer-map``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from executor.hooks import ChannelFactory

logger = logging.getLogger(__name__)

#: Environment variable naming a host's peer-map file (set by :meth:`testbeds.net.Testbed.spawn`).
PEER_MAP_ENV = "FUSION_PEER_MAP"


class PeerMap:
    """Address rewrites from a peer-map file; every address maps to itself without one.

    The file is re-read when it changes (a testbed adds routes as servers start; it
    replaces the file atomically). A file that cannot be read or is not a JSON object of
    strings is reported and ignored (the address is dialled directly).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._version: tuple[int, int, int] | None = None
        self._map: dict[str, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def from_env() -> PeerMap:
        """The map named by :data:`PEER_MAP_ENV`, if any."""
        return PeerMap(os.environ.get(PEER_MAP_ENV) or None)

    def resolve(self, address: str) -> str:
        """The address to dial for ``address``."""
        if self.path is None:
            return address
        with self._lock:
            try:
                st = os.stat(self.path)
                # A new inode each time the testbed replaces the file (mtime alone is too coarse).
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
                if version != self._version:
                    with open(self.path, encoding="utf-8") as f:
                        loaded = json.load(f)  # data only: a dict of strings, checked below
                    if not isinstance(loaded, dict) or not all(
                        isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
                    ):
                        raise ValueError('expected a JSON object of "HOST:PORT": "HOST:PORT" strings')
                    self._map, self._version = loaded, version
            except (OSError, ValueError) as e:
                logger.warning("peer map %s unusable (%s); dialing %s directly", self.path, e, address)
            return self._map.get(address, address)


def peer_map_channels(peers: PeerMap) -> ChannelFactory:
    """A channel factory that dials ``peers.resolve(address)`` instead of ``address``.

    A mapping added after a channel was made does not redirect that channel (the pool
    keeps it): expose a server before anything dials it."""

    def dial(address: str, options: Sequence[tuple[str, int | str]], tls_ca: bytes | None) -> grpc.Channel:
        from executor.hooks import default_channel  # imports torch: only once a channel is dialled

        return default_channel(peers.resolve(address), options, tls_ca)

    return dial


def add_peer_map_arg(parser: argparse.ArgumentParser) -> None:
    """``--peer-map FILE`` (default: ``$FUSION_PEER_MAP``, which the testbed sets)."""
    parser.add_argument(
        "--peer-map",
        default=os.environ.get(PEER_MAP_ENV) or None,
        metavar="FILE",
        help=f"testbed: JSON {{HOST:PORT: PROXYHOST:PROXYPORT}} address rewrites for every peer this process dials "
        f"(default: ${PEER_MAP_ENV}, which the testbed sets on each host's processes)",
    )
