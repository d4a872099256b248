"""Tensors on the wire: dtype + shape + raw bytes, in chunks, never pickled.

A *transfer* is a header (:class:`~fusion.wire.tensor_pb2.TransferHeader`) that names every
tensor with its dtype, shape and byte size, plus the tensors' bytes concatenated and cut
into chunks of at most ``chunk_bytes``. The first :class:`TensorChunk` carries the header;
every chunk carries data. Non-tensor boundary values (sizes, dtypes, devices) travel as
protobuf fields in the header.

The receiver validates the header *before* buffering the payload (the ``check`` callback
can reject unexpected names, shapes or sizes), preallocates exactly the declared size and
refuses a stream that delivers more or less. Every failure is a
:class:`~fusion.errors.WireError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.errors import WireError
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Default chunk size. Big enough that per-message overhead is small next to the copy,
#: small enough that a chunk never approaches gRPC's message limits.
DEFAULT_CHUNK_BYTES = 4 << 20

#: Extra room on top of the chunk size for the header in gRPC's message size limits.
HEADER_ALLOWANCE_BYTES = 1 << 20

_DTYPES: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float64: pb.DTYPE_FLOAT64,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
    torch.int16: pb.DTYPE_INT16,
    torch.int8: pb.DTYPE_INT8,
    torch.uint8: pb.DTYPE_UINT8,
    torch.bool: pb.DTYPE_BOOL,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _DTYPES}

#: Headroom for an encoded tensor above its dense size (headers of tiny tensors).
ENCODED_SLACK_BYTES = 4096

#: Largest number of dimensions accepted on the wire.
MAX_DIMS = 16
#: Largest element count (and dimension) accepted on the wire: 2**40 (4 TiB of fp32).
MAX_NUMEL = 1 << 40


def dtype_to_wire(dtype: torch.dtype) -> int:
    """The wire enum of a torch dtype; ``WireError`` for dtypes fusion does not ship."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot be sent; supported: {sorted(_DTYPE_NAMES)}") from None


def dtype_from_wire(value: int) -> torch.dtype:
    """The torch dtype of a wire enum value; ``WireError`` for unknown values."""
    try:
        return _TORCH_DTYPES[value]
    except KeyError:
        raise WireError(f"unknown wire dtype {value}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` → ``torch.float32`` for the dtypes the wire knows."""
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise WireError(f"unknown dtype name {name!r}; supported: {sorted(_DTYPE_NAMES)}") from None


def tensor_meta(name: str, tensor: torch.Tensor) -> pb.TensorMeta:
    """Header entry of an unencoded tensor."""
    return pb.TensorMeta(
        name=name,
        dtype=dtype_to_wire(tensor.dtype),
        shape=list(tensor.shape),
        size_bytes=tensor.numel() * tensor.element_size(),
        codec=pb.CODEC_NONE,
    )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a tensor (CPU, contiguous; copied only when it is not already)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


# ---------------------------------------------------------------- scalar values
def scalar_to_wire(name: str, value: Any) -> pb.ScalarValue:
    """Encode a non-tensor boundary value (int, float, bool, ints, dtype, device, None)."""
    v = pb.ScalarValue(name=name)
    if isinstance(value, bool):
        v.bool_value = value
    elif isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise WireError(f"value {name!r} = {value} does not fit in 64 bits")
        v.int_value = value
    elif isinstance(value, float):
        v.float_value = value
    elif value is None:
        v.none_value = True
    elif isinstance(value, torch.dtype):
        v.dtype_name = str(value).removeprefix("torch.")
    elif isinstance(value, torch.device):
        v.device_type = value.type
    elif isinstance(value, (tuple, list)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        if any(not -(1 << 63) <= x < (1 << 63) for x in value):
            raise WireError(f"value {name!r} has an entry that does not fit in 64 bits")
        v.int_list.values.extend(value)
    else:
        raise WireError(f"value {name!r} of type {type(value).__name__} cannot cross a stage boundary")
    return v


def scalar_kind(v: pb.ScalarValue) -> str:
    """The :class:`~fusion.graph.ir.ValueMeta` kind of a wire scalar."""
    return {
        "int_value": "int",
        "float_value": "float",
        "bool_value": "bool",
        "int_list": "ints",
        "dtype_name": "dtype",
        "device_type": "device",
        "none_value": "none",
    }.get(v.WhichOneof("kind") or "", "unset")


def scalar_from_wire(v: pb.ScalarValue, device: torch.device) -> Any:
    """Decode a wire scalar; a device value becomes the receiver's own ``device``."""
    kind = v.WhichOneof("kind")
    if kind == "int_value":
        return v.int_value
    if kind == "float_value":
        return v.float_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "int_list":
        return torch.Size(v.int_list.values)
    if kind == "dtype_name":
        return dtype_from_name(v.dtype_name)
    if kind == "device_type":
        return device
    if kind == "none_value":
        return None
    raise WireError(f"scalar value {v.name!r} has no kind set")


# ---------------------------------------------------------------- encode
def payload_views(
    header: pb.TransferHeader,
    tensors: Mapping[str, torch.Tensor],
    encoded: Mapping[str, tuple[pb.TensorMeta, bytes]] | None = None,
) -> list[memoryview]:
    """Fill ``header.tensors`` and return the payload as byte views of the tensors' memory
    (and of the encoded tensors' bytes), in header order."""
    del header.tensors[:]
    views: list[memoryview] = []
    for name, t in tensors.items():
        header.tensors.append(tensor_meta(name, t))
        views.append(tensor_bytes(t))
    for name, (meta, data) in (encoded or {}).items():
        m = header.tensors.add()
        m.CopyFrom(meta)
        m.name = name
        views.append(memoryview(data).cast("B"))
    return views


def _frames(
    header: pb.TransferHeader,
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int,
    encoded: Mapping[str, tuple[pb.TensorMeta, bytes]] | None,
) -> Iterator[tuple[pb.TransferHeader | None, memoryview | bytearray]]:
    """(header or None, data) per chunk; whole chunks are views into tensor memory."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    payloads = payload_views(header, tensors, encoded)
    first: pb.TransferHeader | None = header
    buf = bytearray()
    for view in payloads:
        offset = 0
        while offset < len(view):
            take = min(chunk_bytes - len(buf), len(view) - offset)
            if not buf and take == chunk_bytes:  # a whole chunk straight from the tensor
                yield first, view[offset : offset + take]
                first = None
                offset += take
                continue
            buf += view[offset : offset + take]
            offset += take
            if len(buf) == chunk_bytes:
                yield first, buf
                first = None
                buf = bytearray()
    if buf or first is not None:
        yield first, buf


def encode_transfer(
    header: pb.TransferHeader,
    tensors: Mapping[str, torch.Tensor],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    encoded: Mapping[str, tuple[pb.TensorMeta, bytes]] | None = None,
) -> Iterator[pb.TensorChunk]:
    """Yield the chunks of a transfer as protobuf messages.

    Args:
        header: routing fields; its ``tensors`` list is filled here.
        tensors: raw tensors to send, by name.
        chunk_bytes: maximum payload bytes per chunk.
        encoded: tensors already encoded by a codec, as (meta, bytes), by name.
    """
    for h, data in _frames(header, tensors, chunk_bytes, encoded):
        yield pb.TensorChunk(header=h, data=bytes(data)) if h is not None else pb.TensorChunk(data=bytes(data))


def encode_transfer_wire(
    header: pb.TransferHeader,
    tensors: Mapping[str, torch.Tensor],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    encoded: Mapping[str, tuple[pb.TensorMeta, bytes]] | None = None,
) -> Iterator[bytes]:
    """Like :func:`encode_transfer`, but yield each chunk already serialised.

    The bytes are exactly ``TensorChunk.SerializeToString()``; building them by hand costs
    one copy of the tensor data instead of three (bytes, message, serialisation).
    """
    for h, data in _frames(header, tensors, chunk_bytes, encoded):
        yield serialize_chunk(h, data)


_HEADER_TAG = b"\x0a"  # field 1, length-delimited
_DATA_TAG = b"\x12"  # field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def serialize_chunk(header: pb.TransferHeader | None, data: memoryview | bytes | bytearray) -> bytes:
    """Protobuf wire form of ``TensorChunk(header=header, data=data)``."""
    parts: list[bytes | memoryview | bytearray] = []
    if header is not None:
        hb = header.SerializeToString()
        parts += [_HEADER_TAG, _varint(len(hb)), hb]
    if len(data):
        parts += [_DATA_TAG, _varint(len(data)), data]
    return b"".join(parts)


@dataclass(frozen=True)
class RawChunk:
    """A parsed ``TensorChunk`` whose data is a view into the received bytes (no copy)."""

    header: pb.TransferHeader | None
    data: memoryview


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("malformed chunk: truncated or oversized varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def parse_chunk(raw: bytes) -> RawChunk:
    """Parse the protobuf wire form of a ``TensorChunk`` without copying its data.

    Unknown fields are skipped (forward compatibility); anything malformed raises
    ``WireError``.
    """
    buf = memoryview(raw)
    pos = 0
    header: pb.TransferHeader | None = None
    data = memoryview(b"")
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field_no, wire_type = tag >> 3, tag & 7
        if field_no == 0:
            raise WireError("malformed chunk: field number 0")
        if wire_type == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise WireError("malformed chunk: a field runs past the end of the message")
            value = buf[pos : pos + size]
            pos += size
            if field_no == 1:
                if header is not None:
                    raise WireError("malformed chunk: the header field appears twice")
                try:
                    header = pb.TransferHeader.FromString(value.tobytes())
                except Exception as e:  # protobuf's DecodeError
                    raise WireError(f"malformed transfer header: {e}") from e
            elif field_no == 2:
                data = value
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            if pos > len(buf):
                raise WireError("malformed chunk: truncated fixed-width field")
        else:
            raise WireError(f"malformed chunk: unsupported wire type {wire_type} for field {field_no}")
    return RawChunk(header=header, data=data)


# ---------------------------------------------------------------- decode
@dataclass
class Transfer:
    """A received transfer: its header and payload, validated but not yet decoded."""

    header: pb.TransferHeader
    payload: bytearray
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        """Payload bytes received."""
        return len(self.payload)

    def raw(self, name: str) -> memoryview:
        """The bytes of one tensor."""
        start, end = self.offsets[name]
        return memoryview(self.payload)[start:end]

    def metas(self) -> dict[str, pb.TensorMeta]:
        """Tensor metadata by name."""
        return {m.name: m for m in self.header.tensors}

    def tensors(
        self,
        decode: Callable[[pb.TensorMeta, memoryview], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Materialise every tensor (CPU). Encoded tensors go through ``decode``."""
        out: dict[str, torch.Tensor] = {}
        for meta in self.header.tensors:
            raw = self.raw(meta.name)
            if meta.codec in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED):
                out[meta.name] = raw_to_tensor(meta, raw)
            elif decode is None:
                raise WireError(f"tensor {meta.name!r} uses codec {meta.codec} and no decoder was given")
            else:
                out[meta.name] = decode(meta, raw)
        return out

    def scalars(self, device: torch.device) -> dict[str, Any]:
        """Every non-tensor value, decoded for ``device``."""
        return {v.name: scalar_from_wire(v, device) for v in self.header.values}


def raw_to_tensor(meta: pb.TensorMeta, raw: memoryview) -> torch.Tensor:
    """Rebuild an unencoded tensor from its bytes (the bytes were size-checked on receipt)."""
    dtype = dtype_from_wire(meta.dtype)
    shape = tuple(meta.shape)
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(raw if not raw.readonly else bytearray(raw), dtype=torch.uint8)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()  # misaligned inside the payload: copy once rather than read unaligned
    return flat.view(dtype).reshape(shape)


def expected_raw_bytes(meta: pb.TensorMeta) -> int:
    """Bytes an unencoded tensor with this dtype and shape occupies."""
    dtype = dtype_from_wire(meta.dtype)
    numel = 1
    for s in meta.shape:
        numel *= s
    return numel * dtype.itemsize


def check_header_shape(header: pb.TransferHeader) -> int:
    """Structural checks every header must pass; returns the declared payload size."""
    names = set()
    total = 0
    for meta in header.tensors:
        if not meta.name:
            raise WireError("a tensor in the transfer header has no name")
        if meta.name in names:
            raise WireError(f"tensor {meta.name!r} appears twice in the transfer header")
        names.add(meta.name)
        if len(meta.shape) > MAX_DIMS or any(s < 0 or s > MAX_NUMEL for s in meta.shape):
            raise WireError(f"tensor {meta.name!r} has an invalid shape {list(meta.shape)}")
        numel = 1
        for s in meta.shape:
            numel *= s
        if numel > MAX_NUMEL:
            raise WireError(f"tensor {meta.name!r} declares {numel} elements, above the limit of {MAX_NUMEL}")
        dtype_from_wire(meta.dtype)
        if meta.codec in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED) and meta.size_bytes != expected_raw_bytes(meta):
            raise WireError(
                f"tensor {meta.name!r} declares {meta.size_bytes} bytes "
                f"but dtype and shape need {expected_raw_bytes(meta)}"
            )
        if (
            meta.codec not in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED)
            and meta.size_bytes > 2 * expected_raw_bytes(meta) + ENCODED_SLACK_BYTES
        ):
            raise WireError(
                f"encoded tensor {meta.name!r} declares {meta.size_bytes} bytes, "
                "more than twice its dense size; refusing it"
            )
        total += meta.size_bytes
    for v in header.values:
        if not v.name:
            raise WireError("a scalar value in the transfer header has no name")
        if v.name in names:
            raise WireError(f"value {v.name!r} appears twice in the transfer header")
        names.add(v.name)
    return total


def _as_raw(chunk: pb.TensorChunk | RawChunk) -> RawChunk:
    if isinstance(chunk, RawChunk):
        return chunk
    return RawChunk(header=chunk.header if chunk.HasField("header") else None, data=memoryview(chunk.data))


def decode_transfer(
    chunks: Iterable[pb.TensorChunk | RawChunk],
    *,
    max_bytes: int,
    check: Callable[[pb.TransferHeader], None] | None = None,
) -> Transfer:
    """Read one transfer from a chunk stream, validating as early as possible.

    Args:
        chunks: the request stream.
        max_bytes: refuse transfers whose declared payload exceeds this.
        check: called with the header before any payload is buffered; raises
            ``WireError`` (or another ``FusionError``) to refuse the transfer.
    """
    it = (_as_raw(c) for c in chunks)
    try:
        first = next(it)
    except StopIteration:
        raise WireError("empty transfer: the stream carried no chunk") from None
    if first.header is None:
        raise WireError("the first chunk of a transfer must carry the header")
    header = first.header
    total = check_header_shape(header)
    if total > max_bytes:
        raise WireError(f"transfer declares {total} bytes, above the limit of {max_bytes} for this call")
    if check is not None:
        check(header)
    payload = bytearray(total)
    view = memoryview(payload)
    filled = 0
    chunk: RawChunk | None = first
    while chunk is not None:
        if chunk is not first and chunk.header is not None:
            raise WireError("only the first chunk of a transfer may carry a header")
        n = len(chunk.data)
        if filled + n > total:
            raise WireError(f"transfer carries more than the {total} bytes its header declares")
        view[filled : filled + n] = chunk.data
        filled += n
        chunk = next(it, None)
    if filled != total:
        raise WireError(f"transfer ended after {filled} of {total} declared bytes")
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for meta in header.tensors:
        offsets[meta.name] = (pos, pos + meta.size_bytes)
        pos += meta.size_bytes
    return Transfer(header=header, payload=payload, offsets=offsets)


def grpc_message_options(chunk_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options with explicit message size limits for ``chunk_bytes``."""
    limit = chunk_bytes + HEADER_ALLOWANCE_BYTES
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]
