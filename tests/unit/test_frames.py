"""The data plane (executor/frames.py, stream_server.py, stream_client.py) over real loopback
sockets: round trips, and every refusal followed by the listener serving the next frame."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compress.base import get_compressor
from executor import frames, stream_client, stream_server
from executor.mailbox import ExpectedValue
from executor.stream_client import DataPlaneClient, warmup_bytes
from executor.stream_server import REPLY, DataListener, recv_exact
from executor.transport import dtype_from_wire, payload_views
from fusion.auth import KeyRing, NonceCache, new_key
from fusion.errors import RemoteError, WireError
from fusion.wire import tensor_pb2 as pb

pytestmark = pytest.mark.timeout(60)

JOB = "job-frames"
EXPECTED = {"x": ExpectedValue(kind="tensor", dtype=torch.float32, shape=(4, 8))}


class Sink:
    """Checks names, dtypes and shapes like a stage, and records what it is given."""

    def __init__(self) -> None:
        self.delivered: list[tuple[pb.TransferHeader, dict[str, torch.Tensor]]] = []
        self.event = threading.Event()

    def check(self, header: pb.TransferHeader) -> Any:
        for meta in header.tensors:
            expected = EXPECTED.get(meta.name)
            if expected is not None and meta.codec in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED):
                expected.check(meta.name, meta, None)
        return None

    def deliver(self, handle: Any, header: pb.TransferHeader, tensors: Mapping[str, torch.Tensor]) -> None:
        self.delivered.append((header, dict(tensors)))
        self.event.set()


@pytest.fixture
def keyring() -> KeyRing:
    ring = KeyRing()
    ring.set_job(JOB, new_key())
    return ring


@pytest.fixture
def served(keyring: KeyRing) -> Iterator[tuple[DataListener, Sink]]:
    sink = Sink()
    listener = DataListener("127.0.0.1", keys=keyring.job, nonces=NonceCache(), sink=sink, max_bytes=4 << 20)
    yield listener, sink
    listener.close()


def header(step: int = 1, job: str = JOB) -> pb.TransferHeader:
    return pb.TransferHeader(job_id=job, stage_idx=1, src_stage_idx=0, step=step, micro_batch_idx=0, kind=1)


def client_for(listener: DataListener, keyring: KeyRing, *, local_path: bool = True) -> tuple[DataPlaneClient, str]:
    client = DataPlaneClient(keyring, local_path=local_path)
    address = f"127.0.0.1:{listener.port + 1}"  # the gRPC address; only its host is dialled
    client.learn(address, listener.port)
    return client, address


def raw_frame(key: bytes, h: pb.TransferHeader, tensors: Mapping[str, torch.Tensor], seq: int = 1) -> bytes:
    views = payload_views(h, tensors)
    size = sum(len(v) for v in views)
    head, nonce = frames.encode_head(key, h, size, seq)
    mac = frames.payload_mac(key, nonce)
    for v in views:
        mac.update(v)
    return b"".join([head, *views, mac.finalize()])


def exchange(listener: DataListener, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes on a fresh connection; the answer's status and body ("" if it closed)."""
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        try:
            _, status, _, n = REPLY.unpack(recv_exact(s, REPLY.size, what="answer"))
        except WireError:
            return -1, b""
        return status, recv_exact(s, n, what="body")


def assert_serves_next(listener: DataListener, sink: Sink, keyring: KeyRing) -> None:
    client, address = client_for(listener, keyring)
    x = torch.randn(4, 8)
    sink.event.clear()
    assert client.send(address, header(step=99), {"x": x}) == x.numel() * 4
    assert sink.event.wait(5)
    torch.testing.assert_close(sink.delivered[-1][1]["x"], x)
    client.close()


@pytest.mark.parametrize("path", ["tcp", "unix"])
def test_round_trip_of_raw_encoded_and_scalar_values(
    served: tuple[DataListener, Sink], keyring: KeyRing, path: str
) -> None:
    listener, sink = served
    client, address = client_for(listener, keyring, local_path=path == "unix")
    codec = get_compressor(pb.CODEC_QUANT)
    g = torch.randn(64, 16)
    blob = codec.encode(g, bits=8).data
    meta = pb.TensorMeta(dtype=pb.DTYPE_FLOAT32, shape=[64, 16], size_bytes=len(blob), codec=pb.CODEC_QUANT)
    tensors = {
        "x": torch.randn(4, 8),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "mask": torch.rand(7) > 0.5,
        "empty": torch.zeros(0, 3),
        "big": torch.arange(300_000, dtype=torch.int64),  # a larger payload beside small ones
    }
    for step in (1, 2):  # the second frame reuses the connection (sequence 2)
        sent = client.send(address, header(step), tensors, {"n": 3, "dims": (2, 3)}, encoded={"g": (meta, blob)})
        assert sent == sum(t.numel() * t.element_size() for t in tensors.values()) + len(blob)
    assert len(sink.delivered) == 2
    h, got = sink.delivered[-1]
    assert h.step == 2 and [v.name for v in h.values] == ["n", "dims"]
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    g_meta = next(m for m in h.tensors if m.name == "g")
    assert dtype_from_wire(g_meta.dtype) == torch.float32 and got["g"].shape == (64, 16)
    assert listener.num_frames[path] == client.num_frames[path] == 2 and sum(listener.num_frames.values()) == 2
    client.close()


def test_encode_and_parse_the_prefix(keyring: KeyRing) -> None:
    key = keyring.job(JOB)
    assert key is not None
    data = raw_frame(key, header(), {"x": torch.ones(4, 8)})
    prefix = frames.parse_prefix(data[: frames.PREFIX.size], max_payload_bytes=1 << 20)
    assert (prefix.payload_len, prefix.seq, prefix.job_len) == (128, 1, len(JOB))
    rest = data[frames.PREFIX.size : frames.PREFIX.size + prefix.job_len + prefix.header_len + frames.MAC_BYTES]
    head = frames.verify_head(
        prefix, rest, data[: frames.PREFIX.size], keys=keyring.job, nonces=NonceCache(), expected_seq=1
    )
    assert head.header.job_id == JOB and [m.name for m in head.header.tensors] == ["x"]


def refused(listener: DataListener, data: bytes, match: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="executor.stream_server"):
        status, body = exchange(listener, data)
    assert status in (1, -1)
    assert match in (body.decode() + caplog.text), (body, caplog.text)


def test_wrong_key_is_refused_and_the_next_frame_served(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    refused(listener, raw_frame(new_key(), header(), {"x": torch.ones(4, 8)}), "wrong job key", caplog)
    assert_serves_next(listener, sink, keyring)


def test_unknown_job_is_refused(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    refused(
        listener, raw_frame(new_key(), header(job="other"), {"x": torch.ones(4, 8)}), "its job key is unknown", caplog
    )
    assert_serves_next(listener, sink, keyring)


def test_replayed_frame_is_refused(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    key = keyring.job(JOB)
    assert key is not None
    data = raw_frame(key, header(), {"x": torch.ones(4, 8)})
    assert exchange(listener, data)[0] == 0
    refused(listener, data, "replayed", caplog)  # the same bytes on a new connection
    # ... and within a connection, a frame whose sequence number is not the next one.
    refused(listener, raw_frame(key, header(), {"x": torch.ones(4, 8)}, seq=5), "sequence 5 where 1 was due", caplog)
    assert_serves_next(listener, sink, keyring)


def test_oversized_frame_is_refused_before_its_payload(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    key = keyring.job(JOB)
    assert key is not None
    h = header()
    h.tensors.add(name="x", dtype=pb.DTYPE_FLOAT32, shape=[2 << 20], size_bytes=8 << 20, codec=pb.CODEC_NONE)
    head, _ = frames.encode_head(key, h, 8 << 20, 1)
    refused(listener, head, "above the limit", caplog)  # only the head: no payload was needed
    assert_serves_next(listener, sink, keyring)


def test_truncated_frame_is_refused(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    key = keyring.job(JOB)
    assert key is not None
    data = raw_frame(key, header(), {"x": torch.ones(4, 8)})
    refused(listener, data[:-40], "truncated frame", caplog)
    refused(listener, data[:10], "truncated frame", caplog)
    assert_serves_next(listener, sink, keyring)


def test_bad_header_is_refused(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    key = keyring.job(JOB)
    assert key is not None
    data = bytearray(raw_frame(key, header(), {"x": torch.ones(4, 8)}))
    refused(listener, b"GET / HTTP/1.1\r\n" + bytes(frames.PREFIX.size), "bad frame magic", caplog)
    bad_version = bytearray(data)
    bad_version[4] = 9
    refused(listener, bytes(bad_version), "version 9", caplog)
    altered = bytearray(data)
    altered[frames.PREFIX.size + len(JOB) + 3] ^= 0xFF  # inside the signed header
    refused(listener, bytes(altered), "wrong job key", caplog)
    tampered = bytearray(data)
    tampered[-20] ^= 0xFF  # inside the payload: the tag no longer matches
    refused(listener, bytes(tampered), "does not match its tag", caplog)
    assert_serves_next(listener, sink, keyring)


def test_shape_mismatch_is_refused_with_the_stage_error(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    client, address = client_for(listener, keyring)
    with pytest.raises(RemoteError, match=r"INVALID_ARGUMENT.*shape \[4, 9\], expected \[4, 8\]") as info:
        client.send(address, header(), {"x": torch.ones(4, 9)})
    assert info.value.code == "INVALID_ARGUMENT" and not sink.delivered
    assert_serves_next(listener, sink, keyring)
    client.close()


def test_unreachable_port_falls_back_and_a_dead_peer_fails_the_send(
    served: tuple[DataListener, Sink], keyring: KeyRing
) -> None:
    listener, _ = served
    client, address = client_for(listener, keyring)
    assert client.send(address, header(), {"x": torch.ones(4, 8)}) == 128
    listener.close()  # the peer dies: its open connection breaks mid-exchange
    with pytest.raises(RemoteError) as info:
        client.send(address, header(step=2), {"x": torch.ones(4, 8)})
    assert info.value.code == "UNAVAILABLE"
    assert client.send(address, header(step=3), {"x": torch.ones(4, 8)}) is None  # refused: back to gRPC
    assert client.port(address) is None
    client.learn(address, listener.port)  # the peer keeps advertising the port nobody can reach
    assert client.port(address) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_altered_or_cut_frame_is_refused(
    served: tuple[DataListener, Sink], keyring: KeyRing, data: st.DataObject
) -> None:
    """Every byte of a frame is under the header MAC or the payload tag: flipping any one, or
    cutting the frame anywhere, delivers nothing, and the listener serves the next frame."""
    listener, sink = served
    key = keyring.job(JOB)
    assert key is not None
    frame = bytearray(raw_frame(key, header(), {"x": torch.randn(4, 8)}))
    if data.draw(st.booleans(), label="cut"):
        frame = frame[: data.draw(st.integers(0, len(frame) - 1), label="length")]
    else:
        frame[data.draw(st.integers(0, len(frame) - 1), label="position")] ^= data.draw(st.integers(1, 255))
    before = len(sink.delivered)
    assert exchange(listener, bytes(frame))[0] != 0
    assert len(sink.delivered) == before
    assert_serves_next(listener, sink, keyring)


def test_frame_of_a_replaced_placement_is_refused_as_stale(keyring: KeyRing, caplog: pytest.LogCaptureFixture) -> None:
    old = new_key()
    sink = Sink()
    listener = DataListener(
        "127.0.0.1",
        keys=keyring.job,
        nonces=NonceCache(),
        sink=sink,
        max_bytes=1 << 20,
        retired=lambda job: [old] if job == JOB else [],
    )
    try:
        refused(listener, raw_frame(old, header(), {"x": torch.ones(4, 8)}), "FAILED_PRECONDITION", caplog)
        assert "placement that was replaced" in caplog.text
        refused(listener, raw_frame(new_key(), header(), {"x": torch.ones(4, 8)}), "UNAUTHENTICATED", caplog)
        assert_serves_next(listener, sink, keyring)
    finally:
        listener.close()


# ---------------------------------------------------------------- warm-up frames


def slow_connect(delay_s: float) -> Any:
    """A connection factory whose connect takes ``delay_s`` more, as a long link's would."""

    def connect(host: str, port: int) -> socket.socket:
        time.sleep(delay_s)
        return socket.create_connection((host, port), timeout=5)

    return connect


def test_warmup_bytes_are_three_bandwidth_delay_products_within_limits() -> None:
    assert warmup_bytes(12.5e6, 0.04) == 1_500_000  # 100 Mbps, 40 ms
    assert warmup_bytes(125e6, 0.0001) == 0  # a LAN: under MIN_WARMUP_BYTES
    assert warmup_bytes(1.25e9, 0.15) == frames.MAX_WARMUP_BYTES
    assert warmup_bytes(0.0, 0.1) == 0


def test_a_new_connection_over_a_long_link_is_warmed_up_once(
    served: tuple[DataListener, Sink], keyring: KeyRing
) -> None:
    listener, sink = served
    client = DataPlaneClient(keyring, connect=slow_connect(0.05))
    address = f"127.0.0.1:{listener.port + 1}"
    client.learn(address, listener.port)
    x = torch.randn(4, 8)
    for step in (1, 2):  # the second transfer reuses the warmed connection
        assert client.send(address, header(step), {"x": x}, link_bytes_per_s=20e6) == 128
    assert client.num_warmups == listener.num_warmups == 1
    assert [h.step for h, _ in sink.delivered] == [1, 2]  # the warm-up reached no stage
    torch.testing.assert_close(sink.delivered[-1][1]["x"], x)
    client.close()


def test_no_warmup_where_the_link_bandwidth_is_unknown(served: tuple[DataListener, Sink], keyring: KeyRing) -> None:
    listener, _ = served
    client = DataPlaneClient(keyring, connect=slow_connect(0.05))
    address = f"127.0.0.1:{listener.port + 1}"
    client.learn(address, listener.port)
    assert client.send(address, header(), {"x": torch.randn(4, 8)}) == 128
    assert client.num_warmups == listener.num_warmups == 0
    client.close()


def test_a_peer_that_refuses_warm_ups_still_gets_the_transfer(
    served: tuple[DataListener, Sink],
    keyring: KeyRing,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    listener, sink = served
    monkeypatch.setattr(stream_client, "warmup_bytes", lambda *_: frames.MAX_WARMUP_BYTES + 1)
    client = DataPlaneClient(keyring, connect=slow_connect(0.0))
    address = f"127.0.0.1:{listener.port + 1}"
    client.learn(address, listener.port)
    with caplog.at_level(logging.INFO):
        assert client.send(address, header(), {"x": torch.randn(4, 8)}, link_bytes_per_s=1e9) == 128
    assert "refused a warm-up" in caplog.text and "above the limit" in caplog.text
    assert client.num_warmups == listener.num_warmups == 0 and len(sink.delivered) == 1
    client.close()


def test_bad_warm_up_frames_are_refused_and_the_next_frame_served(
    served: tuple[DataListener, Sink], keyring: KeyRing, caplog: pytest.LogCaptureFixture
) -> None:
    listener, sink = served
    key = keyring.job(JOB)
    assert key is not None

    def warmup(h: pb.TransferHeader, size: int, signer: bytes = key) -> bytes:
        head, nonce = frames.encode_head(signer, h, size, 1, ftype=frames.TYPE_WARMUP)
        mac = frames.payload_mac(signer, nonce)
        mac.update(bytes(size))
        return head + bytes(size) + mac.finalize()

    plain = pb.TransferHeader(job_id=JOB)
    assert exchange(listener, warmup(plain, 4096)) == (0, b"") and listener.num_warmups == 1
    head, _ = frames.encode_head(key, plain, frames.MAX_WARMUP_BYTES + 1, 1, ftype=frames.TYPE_WARMUP)
    refused(listener, head, "warm-up frame declares", caplog)
    with_tensor = header()
    with_tensor.tensors.add(name="x", dtype=pb.DTYPE_FLOAT32, shape=[4], size_bytes=16, codec=pb.CODEC_NONE)
    refused(listener, warmup(with_tensor, 16), "a warm-up frame names 1 tensors", caplog)
    refused(listener, warmup(plain, 4096, new_key()), "wrong job key", caplog)
    refused(listener, warmup(plain, 4096)[:-1] + b"\0", "does not match its tag", caplog)
    assert listener.num_warmups == 1 and not sink.delivered
    assert_serves_next(listener, sink, keyring)


def answer(s: socket.socket) -> int:
    """The status of the listener's answer on ``s``."""
    return REPLY.unpack(recv_exact(s, REPLY.size, what="answer"))[1]


def test_a_sender_that_stalls_inside_a_frame_is_cut_off_at_its_bound(
    served: tuple[DataListener, Sink], keyring: KeyRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener, sink = served
    monkeypatch.setattr(stream_server, "transfer_timeout_s", lambda n: 0.3)
    key = keyring.job(JOB)
    assert key is not None
    data = raw_frame(key, header(), {"x": torch.ones(4, 8)})
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
        s.sendall(data[:-40])  # stops inside the payload and stays connected
        t0 = time.monotonic()
        assert s.recv(1) == b""  # the listener gave up on it
        assert 0.25 < time.monotonic() - t0 < 5
    assert not sink.delivered
    assert_serves_next(listener, sink, keyring)


def test_an_idle_connection_outlives_the_frame_bound_until_the_idle_limit(
    served: tuple[DataListener, Sink], keyring: KeyRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener, sink = served
    monkeypatch.setattr(stream_server, "transfer_timeout_s", lambda n: 0.2)
    monkeypatch.setattr(stream_server, "IDLE_TIMEOUT_S", 1.0)
    key = keyring.job(JOB)
    assert key is not None
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
        s.sendall(raw_frame(key, header(step=1), {"x": torch.ones(4, 8)}, seq=1))
        assert answer(s) == 0
        time.sleep(0.6)  # three frame bounds without a byte: the connection is kept
        s.sendall(raw_frame(key, header(step=2), {"x": torch.ones(4, 8)}, seq=2))
        assert answer(s) == 0
        t0 = time.monotonic()
        assert s.recv(1) == b""  # idle past the limit: closed
        assert 0.8 < time.monotonic() - t0 < 5
    assert [h.step for h, _ in sink.delivered] == [1, 2]


def test_a_peer_that_never_answers_fails_the_send_at_its_bound(
    keyring: KeyRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_client, "transfer_timeout_s", lambda n: 0.3)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        client = DataPlaneClient(keyring, local_path=False)
        client.learn("127.0.0.1:1", silent.getsockname()[1])
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="UNAVAILABLE.*timed out: no progress for 0.3 s") as e:
            client.send("127.0.0.1:1", header(), {"x": torch.ones(4, 8)})
        assert e.value.code == "UNAVAILABLE" and 0.25 < time.monotonic() - t0 < 5
        client.close()
