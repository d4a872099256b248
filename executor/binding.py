"""Bind the Executor service to gRPC, with zero-copy framing for tensor streams.

The generated stub and servicer registration (de)serialise every ``TensorChunk`` through
protobuf messages, which copies each chunk's data several times. Here, methods whose
request or response is a ``TensorChunk`` use :func:`executor.transport.parse_chunk` and
pre-serialised bytes instead (the bytes on the wire are the same protobuf encoding, so
any protobuf peer interoperates); every other method uses the generated message classes.
The method table is read from the service descriptor, so it cannot drift from the .proto.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory

from executor.access import guard, job_id_of, lenient
from executor.transport import parse_chunk
from fusion.wire import executor_pb2 as epb

SERVICE = epb.DESCRIPTOR.services_by_name["Executor"]
CHUNK_TYPE = "fusion.wire.TensorChunk"


def _identity(b: bytes) -> bytes:
    return b


def _codecs(
    method: Any,
) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes], Callable[[Any], bytes], Callable[[bytes], Any]]:
    """(request deserialiser, response serialiser, request serialiser, response deserialiser)."""
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    req_in = parse_chunk if method.input_type.full_name == CHUNK_TYPE else req_cls.FromString
    req_out = _identity if method.input_type.full_name == CHUNK_TYPE else req_cls.SerializeToString
    resp_out = _identity if method.output_type.full_name == CHUNK_TYPE else resp_cls.SerializeToString
    resp_in = parse_chunk if method.output_type.full_name == CHUNK_TYPE else resp_cls.FromString
    return req_in, resp_out, req_out, resp_in


def executor_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """A generic handler serving ``servicer``'s methods under ``fusion.wire.Executor``.

    Handlers of tensor chunks (streams, and the unary ``SendWhole``/``ProbeWhole``) receive
    :class:`~executor.transport.RawChunk` objects and GetState yields pre-serialised chunk
    bytes. Every method is wrapped by the access checks of ``servicer.access``
    (:mod:`executor.access`): credential, deadline, per-peer limits, and requests that do
    not parse answered ``INVALID_ARGUMENT``.
    """
    handlers = {}
    for method in SERVICE.methods:
        req_in, resp_out, _, _ = _codecs(method)
        req_in = lenient(req_in)
        fn = guard(
            method.name, getattr(servicer, method.name), servicer.access, client_streaming=method.client_streaming
        )
        if method.client_streaming and not method.server_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming and not method.client_streaming:
            make = grpc.unary_stream_rpc_method_handler
        elif not method.client_streaming and not method.server_streaming:
            make = grpc.unary_unary_rpc_method_handler
        else:
            make = grpc.stream_stream_rpc_method_handler
        handlers[method.name] = make(fn, request_deserializer=req_in, response_serializer=resp_out)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


class ExecutorStub:
    """Client stub with the same method names as the generated one, tensor streams as bytes.

    ``Send``/``SetState``/``Probe`` take an iterator of serialised chunks
    (:func:`executor.transport.encode_transfer_wire`), ``SendWhole``/``ProbeWhole`` one
    serialised chunk; ``GetState`` yields :class:`~executor.transport.RawChunk` objects.
    """

    def __init__(self, channel: grpc.Channel, *, sign: Signer | None = None) -> None:
        for method in SERVICE.methods:
            _, _, req_out, resp_in = _codecs(method)
            path = f"/{SERVICE.full_name}/{method.name}"
            if method.client_streaming and not method.server_streaming:
                call = channel.stream_unary(path, request_serializer=req_out, response_deserializer=resp_in)
            elif method.server_streaming and not method.client_streaming:
                call = channel.unary_stream(path, request_serializer=req_out, response_deserializer=resp_in)
            elif not method.client_streaming:
                call = channel.unary_unary(path, request_serializer=req_out, response_deserializer=resp_in)
            else:
                call = channel.stream_stream(path, request_serializer=req_out, response_deserializer=resp_in)
            setattr(self, method.name, _Signed(call, method.name, sign) if sign is not None else call)


#: ``(rpc name, job id) -> metadata`` for one call (see :meth:`fusion.auth.KeyRing.metadata`).
Signer = Callable[[str, str], tuple[tuple[str, str], ...]]


class _Signed:
    """A stub method that attaches a fresh credential to every call made without metadata.

    The credential may depend on the job the request names: for a request stream, the
    first item is peeked (a serialised ``TensorChunk`` header or a message's ``job_id``).
    """

    def __init__(self, call: Any, name: str, sign: Signer) -> None:
        self._call = call
        self._name = name
        self._sign = sign

    def __call__(self, request: Any, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        if metadata is None:
            request, job_id = _with_job_id(request)
            metadata = self._sign(self._name, job_id)
        return self._call(request, *args, metadata=metadata, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


def _with_job_id(request: Any) -> tuple[Any, str]:
    """(the request, unchanged in content, and the job id it names or ``""``)."""
    if hasattr(request, "DESCRIPTOR"):
        return request, job_id_of(request) or ""
    if isinstance(request, (bytes, bytearray, memoryview)):  # one serialised TensorChunk
        return request, job_id_of(parse_chunk(request)) or ""
    it = iter(request)
    first = next(it, None)
    if first is None:
        return iter(()), ""
    item = parse_chunk(first) if isinstance(first, (bytes, bytearray, memoryview)) else first
    return itertools.chain([first], it), job_id_of(item) or ""
