"""Which RPC a transfer takes: one unary message when it fits in one chunk, a stream
otherwise (``ExecutorClient._transfer``). The stub records calls instead of dialing; the
real server side of both paths is exercised in ``tests/integration/test_bad_input.py``
and by every multi-process test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from executor.client import ChannelPool, ExecutorClient
from executor.transport import decode_transfer, parse_chunk
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

CHUNK_BYTES = 1024


class RecordingStub:
    """Stands in for the gRPC stub: decodes what each method is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def _unary(self, name: str, response: Any) -> Any:
        def call(request: bytes, timeout: float) -> Any:
            assert isinstance(request, bytes) and timeout > 0
            self.calls.append((name, [request]))
            return response

        return call

    def _stream(self, name: str, response: Any) -> Any:
        def call(request: Iterator[bytes], timeout: float) -> Any:
            self.calls.append((name, list(request)))
            return response

        return call

    def __getattr__(self, name: str) -> Any:
        response = epb.SendResponse() if name.startswith("Send") else epb.ProbeResponse()
        return self._unary(name, response) if name.endswith("Whole") else self._stream(name, response)


@pytest.fixture
def client() -> Iterator[ExecutorClient]:
    pool = ChannelPool(chunk_bytes=CHUNK_BYTES)
    c = ExecutorClient("127.0.0.1:1", pool)  # never dialed: the stub is replaced
    c.stub = RecordingStub()  # type: ignore[assignment]
    yield c
    pool.close()


@pytest.mark.parametrize(
    ("numel", "method", "num_chunks"),
    [
        (0, "SendWhole", 1),
        (1, "SendWhole", 1),
        (CHUNK_BYTES // 4, "SendWhole", 1),  # exactly one chunk
        (CHUNK_BYTES // 4 + 1, "Send", 2),  # one element over
    ],
)
def test_one_message_up_to_a_chunk_then_a_stream(
    client: ExecutorClient, numel: int, method: str, num_chunks: int
) -> None:
    t = torch.arange(numel, dtype=torch.float32)
    client.send(pb.TransferHeader(job_id="j", stage_idx=1, kind=pb.TRANSFER_KIND_ACTIVATION), {"x": t})
    [(called, chunks)] = client.stub.calls  # type: ignore[attr-defined]
    assert (called, len(chunks)) == (method, num_chunks)
    got = decode_transfer([parse_chunk(c) for c in chunks], max_bytes=1 << 20).tensors()
    torch.testing.assert_close(got["x"], t)


def test_probes_take_the_path_their_size_would(client: ExecutorClient) -> None:
    client.probe(CHUNK_BYTES)
    client.probe(CHUNK_BYTES + 1)
    assert [(m, len(c)) for m, c in client.stub.calls] == [("ProbeWhole", 1), ("Probe", 2)]  # type: ignore[attr-defined]


class Unimplemented(grpc.RpcError):
    """What a worker of an older release answers to a method it does not know."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self) -> str:
        return "Method not found!"


def test_a_peer_without_one_message_transfers_gets_the_stream(client: ExecutorClient) -> None:
    stub = client.stub

    def old_worker(request: bytes, timeout: float) -> Any:
        stub.calls.append(("SendWhole", [request]))  # type: ignore[attr-defined]
        raise Unimplemented()

    stub.SendWhole = old_worker  # type: ignore[attr-defined]
    header = pb.TransferHeader(job_id="j", stage_idx=1, kind=pb.TRANSFER_KIND_ACTIVATION)
    client.send(header, {"x": torch.ones(3)})
    client.send(header, {"x": torch.ones(3)})  # remembered: straight to the stream
    assert [m for m, _ in stub.calls] == ["SendWhole", "Send", "Send"]  # type: ignore[attr-defined]
    assert client.address in client.pool.stream_only
