"""The data plane's local path (executor/local_socket.py): a peer on this machine is reached
over its listener's Unix socket with the same frames and checks as over TCP; every refusal
there is answered and the next correct frame served; without the socket, TCP is used."""

from __future__ import annotations

import logging
import os
import socket
import sys

import pytest
import torch

from executor import local_socket
from executor.stream_client import DataPlaneClient
from executor.stream_server import REPLY, DataListener, recv_exact
from fusion.auth import KeyRing, NonceCache, new_key
from fusion.errors import WireError
from tests.unit.test_frames import JOB, Sink, client_for, header, raw_frame

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux-only"),
]


@pytest.fixture
def keyring() -> KeyRing:
    ring = KeyRing()
    ring.set_job(JOB, new_key())
    return ring


def listener_for(keyring: KeyRing, sink: Sink, **kwargs: object) -> DataListener:
    return DataListener("127.0.0.1", keys=keyring.job, nonces=NonceCache(), sink=sink, max_bytes=4 << 20, **kwargs)


def local_exchange(listener: DataListener, data: bytes) -> tuple[int, str]:
    """Raw bytes on a fresh connection to the listener's Unix socket; the answer's status and
    body (-1 and "" when it closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(local_socket.local_name("127.0.0.1", listener.port))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        try:
            _, status, _, n = REPLY.unpack(recv_exact(s, REPLY.size, what="answer"))
        except WireError:
            return -1, ""
        return status, recv_exact(s, n, what="body").decode()


def serves_next_locally(listener: DataListener, sink: Sink, keyring: KeyRing, step: int) -> None:
    client, address = client_for(listener, keyring)
    x = torch.randn(4, 8)
    before = listener.num_frames["unix"]
    assert client.send(address, header(step=step), {"x": x}) == x.numel() * 4
    torch.testing.assert_close(sink.delivered[-1][1]["x"], x)
    assert listener.num_frames["unix"] == before + 1 and client.num_frames == {"tcp": 0, "unix": 1}
    client.close()


def test_a_co_located_transfer_takes_the_unix_socket(keyring: KeyRing) -> None:
    sink = Sink()
    listener = listener_for(keyring, sink)
    try:
        assert listener.local is not None
        assert listener.local.family == socket.AF_UNIX
        assert listener.local.getsockname() == local_socket.local_name("127.0.0.1", listener.port).encode()
        serves_next_locally(listener, sink, keyring, step=1)
        # The same listener, dialled by a client told not to use the local path: TCP.
        client, address = client_for(listener, keyring, local_path=False)
        assert client.send(address, header(step=2), {"x": torch.ones(4, 8)}) == 128
        assert listener.num_frames == {"tcp": 1, "unix": 1} and client.num_frames == {"tcp": 1, "unix": 0}
        client.close()
    finally:
        listener.close()
    # Closing the listener releases its name: nothing is left to connect to.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(ConnectionRefusedError):
        s.connect(local_socket.local_name("127.0.0.1", listener.port))


def test_refusals_on_the_unix_socket_are_answered_and_the_next_frame_served(
    keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    sink = Sink()
    listener = listener_for(keyring, sink)
    key = keyring.job(JOB)
    assert key is not None
    try:
        with caplog.at_level(logging.WARNING, logger="executor.stream_server"):
            status, body = local_exchange(listener, raw_frame(new_key(), header(), {"x": torch.ones(4, 8)}))
            assert status == 1 and "UNAUTHENTICATED" in body and "wrong job key" in body, body
            serves_next_locally(listener, sink, keyring, step=10)

            frame = raw_frame(key, header(step=2), {"x": torch.ones(4, 8)})
            assert local_exchange(listener, frame)[0] == 0
            status, body = local_exchange(listener, frame)  # the same bytes again
            assert status == 1 and "replayed" in body, body
            serves_next_locally(listener, sink, keyring, step=11)

            fresh = raw_frame(key, header(step=3), {"x": torch.ones(4, 8)})
            status, body = local_exchange(listener, fresh[:-40])  # cut inside the payload
            assert status == 1 and "truncated frame" in body, body
            serves_next_locally(listener, sink, keyring, step=12)
        assert listener.num_refused == 3 and listener.num_frames == {"tcp": 0, "unix": 4}
        assert f"local uid {os.getuid()}" in caplog.text  # refusals name the local peer's user
        assert [h.step for h, _ in sink.delivered] == [10, 2, 11, 12]
    finally:
        listener.close()


def test_without_a_local_socket_the_peer_is_reached_over_tcp(keyring: KeyRing) -> None:
    sink = Sink()
    listener = listener_for(keyring, sink, local_path=False)
    try:
        assert listener.local is None
        client, address = client_for(listener, keyring)
        assert client.send(address, header(), {"x": torch.ones(4, 8)}) == 128
        assert client.num_frames == {"tcp": 1, "unix": 0} and listener.num_frames == {"tcp": 1, "unix": 0}
        client.close()
    finally:
        listener.close()


def test_a_custom_connection_factory_is_never_bypassed(keyring: KeyRing) -> None:
    sink = Sink()
    listener = listener_for(keyring, sink)
    dialled: list[tuple[str, int]] = []

    def connect(host: str, port: int) -> socket.socket:
        dialled.append((host, port))
        return socket.create_connection((host, port), timeout=5)

    try:
        client = DataPlaneClient(keyring, connect=connect)
        address = f"127.0.0.1:{listener.port + 1}"
        client.learn(address, listener.port)
        assert client.send(address, header(), {"x": torch.ones(4, 8)}) == 128
        assert dialled == [("127.0.0.1", listener.port)] and listener.num_frames == {"tcp": 1, "unix": 0}
        client.close()
    finally:
        listener.close()


def test_only_this_machines_addresses_look_for_a_local_socket() -> None:
    assert local_socket.is_local_address("127.0.0.1") and local_socket.is_local_address("localhost")
    assert not local_socket.is_local_address("203.0.113.77")  # TEST-NET-3 (RFC 5737): not an interface here
    assert local_socket.local_name("localhost", 7) == local_socket.local_name("127.0.0.1", 7)
