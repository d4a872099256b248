"""The peer map (:mod:`testbeds.peer_map`): how a testbed's fusion process finds the link proxy for a peer."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from executor.client import ChannelPool
from testbeds.peer_map import PeerMap, peer_map_channels


def _write(path: Path, mapping: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(mapping))
    os.replace(tmp, path)  # as a testbed does: atomic, a new inode each time


def test_unset_maps_every_address_to_itself() -> None:
    assert PeerMap(None).resolve("10.0.0.1:5000") == "10.0.0.1:5000"


def test_mapped_addresses_are_rewritten_and_reloaded_on_replace(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    _write(path, {"127.0.10.2:5000": "127.0.10.1:6000"})
    peers = PeerMap(str(path))
    assert peers.resolve("127.0.10.2:5000") == "127.0.10.1:6000"
    assert peers.resolve("127.0.10.3:5000") == "127.0.10.3:5000"
    _write(path, {"127.0.10.2:5000": "127.0.10.1:6000", "127.0.10.3:5000": "127.0.10.1:6001"})  # same tick, new inode
    assert peers.resolve("127.0.10.3:5000") == "127.0.10.1:6001"


@pytest.mark.parametrize("content", ['["not", "a", "map"]', '{"a:1": 5}', "{broken"])
def test_a_bad_file_means_direct_dialing(tmp_path: Path, content: str) -> None:
    path = tmp_path / "peers.json"
    path.write_text(content)
    assert PeerMap(str(path)).resolve("10.0.0.1:5000") == "10.0.0.1:5000"


def test_channel_pool_dials_the_mapped_address(tmp_path: Path) -> None:
    """A channel to an unroutable address connects to the listener the map names."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(10.0)
        path = tmp_path / "peers.json"
        _write(
            path, {"192.0.2.1:5000": f"127.0.0.1:{listener.getsockname()[1]}"}
        )  # 192.0.2.0/24: TEST-NET, never routed
        pool = ChannelPool(channel_factory=peer_map_channels(PeerMap(str(path))))
        try:
            channel = pool.get("192.0.2.1:5000")
            assert pool.get("192.0.2.1:5000") is channel  # still keyed by the real address
            # A call makes gRPC dial. (Not channel.subscribe(try_to_connect=True): its watcher
            # thread polls until the channel closes and then raises, a warning pinned on
            # whichever test runs next.)
            call = channel.unary_unary("/fusion.test/Dial").future(b"", timeout=10.0)
            conn, _ = listener.accept()  # times out (fails) if gRPC dialed the real address
            conn.close()
            call.cancel()
        finally:
            pool.close()
