"""Bind the Executor service to gRPC, with zero-copy framing for tensor streams.

The generated stub and servicer registration (de)serialise every ``TensorChunk`` through
protobuf messages, which copies each chunk's data several times. Here, methods whose
request or response is a ``TensorChunk`` use :func:`executor.transport.parse_chunk` and
pre-serialised bytes instead (the bytes on the wire are the same protobuf encoding, so
any protobuf peer interoperates); every other method uses the generated message classes.
The method table is read from the service descriptor, so it cannot drift from the .proto.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory

from executor.transport import parse_chunk
from fusion.wire import executor_pb2 as epb

SERVICE = epb.DESCRIPTOR.services_by_name["Executor"]
CHUNK_TYPE = "fusion.wire.TensorChunk"


def _identity(b: bytes) -> bytes:
    return b


def _codecs(method: Any) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes], Callable[[Any], bytes], Callable[[bytes], Any]]:
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

    Tensor-stream handlers receive :class:`~executor.transport.RawChunk` objects and
    GetState yields pre-serialised chunk bytes.
    """
    handlers = {}
    for method in SERVICE.methods:
        req_in, resp_out, _, _ = _codecs(method)
        fn = getattr(servicer, method.name)
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
    (:func:`executor.transport.encode_transfer_wire`); ``GetState`` yields
    :class:`~executor.transport.RawChunk` objects.
    """

    def __init__(self, channel: grpc.Channel) -> None:
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
            setattr(self, method.name, call)
