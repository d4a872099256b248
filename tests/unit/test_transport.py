"""Tensors on the wire: chunked round trips, scalar values, and refusal of malformed streams."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.transport import (
    MAX_DIMS,
    RawChunk,
    Transfer,
    check_header_shape,
    decode_transfer,
    dtype_from_name,
    dtype_from_wire,
    dtype_to_wire,
    encode_transfer,
    encode_transfer_wire,
    expected_raw_bytes,
    parse_chunk,
    scalar_from_wire,
    scalar_kind,
    scalar_to_wire,
    serialize_chunk,
)
from fusion.errors import FusionError, WireError
from fusion.wire import tensor_pb2 as pb

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic values that use the whole range of the dtype's bytes."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64).to(
        dtype
    )


def header() -> pb.TransferHeader:
    return pb.TransferHeader(
        job_id="job", stage_idx=2, src_stage_idx=1, step=7, micro_batch_idx=3, kind=pb.TRANSFER_KIND_ACTIVATION
    )


def encode(
    tensors: Mapping[str, torch.Tensor], *, chunk_bytes: int = 1 << 20, values: Mapping[str, object] | None = None
) -> list[pb.TensorChunk]:
    h = header()
    for name, value in (values or {}).items():
        h.values.append(scalar_to_wire(name, value))
    return list(encode_transfer(h, tensors, chunk_bytes=chunk_bytes))


def round_trip(
    tensors: Mapping[str, torch.Tensor], *, chunk_bytes: int = 1 << 20, values: Mapping[str, object] | None = None
) -> tuple[Transfer, list[pb.TensorChunk]]:
    chunks = encode(tensors, chunk_bytes=chunk_bytes, values=values)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # Stream shape: header only on the first chunk, no chunk over the limit, nothing lost.
    assert chunks[0].HasField("header")
    assert not any(c.HasField("header") for c in chunks[1:])
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert all(len(c.data) > 0 for c in chunks[1:])
    assert sum(len(c.data) for c in chunks) == total
    assert len(chunks) == max(1, math.ceil(total / chunk_bytes))
    transfer = decode_transfer(iter(chunks), max_bytes=total)
    assert transfer.size_bytes == total
    out = transfer.tensors()
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        got = out[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name
    return transfer, chunks


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype: torch.dtype) -> None:
    round_trip({"t": make_tensor((3, 5), dtype)})
    round_trip({"t": make_tensor((3, 5), dtype)}, chunk_bytes=7)
    assert dtype_from_wire(dtype_to_wire(dtype)) == dtype
    assert dtype_from_name(str(dtype).removeprefix("torch.")) == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_zero_dim_tensor(dtype: torch.dtype) -> None:
    transfer, _ = round_trip({"scalar": make_tensor((), dtype)}, chunk_bytes=1)
    assert list(transfer.metas()["scalar"].shape) == []


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5)])
def test_empty_tensors(shape: tuple[int, ...]) -> None:
    _, chunks = round_trip({"empty": torch.zeros(shape), "after": torch.arange(3)})
    assert sum(len(c.data) for c in chunks) == 3 * 8


def test_only_empty_tensors_make_one_header_chunk() -> None:
    transfer, chunks = round_trip({"a": torch.zeros(0), "b": torch.zeros(2, 0, dtype=torch.int8)})
    assert len(chunks) == 1 and chunks[0].data == b""
    assert transfer.size_bytes == 0


def test_no_tensors_at_all() -> None:
    transfer, chunks = round_trip({}, values={"n": 3})
    assert len(chunks) == 1
    assert transfer.tensors() == {}
    assert transfer.scalars(torch.device("cpu")) == {"n": 3}


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # transposed
        lambda: torch.arange(40, dtype=torch.int16).reshape(5, 8)[:, ::3],  # strided columns
        lambda: torch.arange(30, dtype=torch.float64).reshape(5, 6)[1:4, 2:],  # offset view
        lambda: torch.arange(6, dtype=torch.float32).reshape(1, 6).expand(4, 6),  # stride 0
        lambda: torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)[1],  # contiguous with offset
    ],
    ids=["transposed", "strided", "offset-view", "expanded", "row"],
)
def test_non_contiguous_tensors(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    round_trip({"t": t}, chunk_bytes=5)


def test_requires_grad_tensor_is_sent_as_data() -> None:
    t = torch.randn(3, 4, requires_grad=True)
    transfer, _ = round_trip({"t": t})
    assert not transfer.tensors()["t"].requires_grad


def test_several_tensors_in_one_transfer() -> None:
    tensors = {
        "hidden": make_tensor((2, 3, 4), torch.float32, seed=1),
        "mask": make_tensor((2, 3), torch.bool, seed=2),
        "ids": make_tensor((5,), torch.int64, seed=3),
        "half": make_tensor((3, 3), torch.float16, seed=4),
        "byte": make_tensor((7,), torch.uint8, seed=5),
    }
    for chunk_bytes in (1, 7, 13, 1000, 1 << 20):
        transfer, _ = round_trip(tensors, chunk_bytes=chunk_bytes)
    assert [m.name for m in transfer.header.tensors] == list(tensors)
    offsets = [transfer.offsets[n] for n in tensors]
    assert offsets[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:], strict=False)), (
        "payloads are concatenated in header order"
    )


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1000])
def test_chunks_split_tensors_mid_way(chunk_bytes: int) -> None:
    tensors = {"a": make_tensor((37,), torch.float32), "b": make_tensor((11, 3), torch.float64, seed=1)}
    round_trip(tensors, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("chunk_bytes", [4, 8, 16, 32, 64])
def test_chunks_at_tensor_boundaries(chunk_bytes: int) -> None:
    # Two 16-byte tensors: chunk sizes that divide, equal or cover them exactly.
    tensors = {"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(2, dtype=torch.int64)}
    _, chunks = round_trip(tensors, chunk_bytes=chunk_bytes)
    assert len(chunks) == max(1, 32 // chunk_bytes)


def test_header_fields_survive() -> None:
    transfer, _ = round_trip({"t": torch.ones(2)})
    h = transfer.header
    assert (h.job_id, h.stage_idx, h.src_stage_idx, h.step, h.micro_batch_idx, h.kind) == (
        "job",
        2,
        1,
        7,
        3,
        pb.TRANSFER_KIND_ACTIVATION,
    )


def test_encode_fills_the_header_tensor_list_afresh() -> None:
    h = header()
    h.tensors.add(name="stale", dtype=pb.DTYPE_FLOAT32, shape=[1], size_bytes=4)
    chunks = list(encode_transfer(h, {"t": torch.ones(2)}))
    assert [m.name for m in chunks[0].header.tensors] == ["t"]


def test_decoded_tensors_are_writable_and_independent() -> None:
    transfer, _ = round_trip({"a": torch.zeros(4), "b": torch.ones(4)})
    out = transfer.tensors()
    out["a"] += 5
    assert torch.equal(out["b"], torch.ones(4))


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError):
        list(encode_transfer(header(), {"t": torch.ones(1)}, chunk_bytes=0))


def test_unsupported_dtype_is_refused_on_encode() -> None:
    with pytest.raises(WireError, match="cannot be sent"):
        list(encode_transfer(header(), {"t": torch.zeros(2, dtype=torch.complex64)}))


# ---------------------------------------------------------------- scalar values
@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (0, "int"),
        (-(2**63), "int"),
        (2**63 - 1, "int"),
        (1.5, "float"),
        (-0.0, "float"),
        (float("inf"), "float"),
        (True, "bool"),
        (False, "bool"),
        (None, "none"),
        (torch.float16, "dtype"),
        (torch.bool, "dtype"),
    ],
)
def test_scalar_values_round_trip(value: object, kind: str) -> None:
    transfer, _ = round_trip({"t": torch.ones(1)}, values={"v": value})
    (wire,) = transfer.header.values
    assert scalar_kind(wire) == kind
    got = transfer.scalars(torch.device("cpu"))["v"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("value", [(2, 3, 4), [5], (), torch.Size([1, 0, 7])])
def test_int_tuples_become_sizes(value: object) -> None:
    transfer, _ = round_trip({}, values={"size": value})
    got = transfer.scalars(torch.device("cpu"))["size"]
    assert isinstance(got, torch.Size)
    assert got == torch.Size(value)


def test_device_becomes_the_receivers_device() -> None:
    transfer, _ = round_trip({}, values={"dev": torch.device("cuda", 1)})
    assert scalar_kind(transfer.header.values[0]) == "device"
    assert transfer.scalars(torch.device("cpu")) == {"dev": torch.device("cpu")}
    assert transfer.scalars(torch.device("meta")) == {"dev": torch.device("meta")}


def test_several_scalars_keep_names() -> None:
    values = {"b": 2, "t": 8, "dtype": torch.float32, "shape": (2, 8), "flag": False}
    transfer, _ = round_trip({"x": torch.ones(2)}, values=values)
    got = transfer.scalars(torch.device("cpu"))
    assert got == {**values, "shape": torch.Size([2, 8])}


@pytest.mark.parametrize("value", [object(), "text", (1, 2.5), (True, False), {"a": 1}, torch.ones(1)])
def test_unsendable_scalars_are_refused(value: object) -> None:
    with pytest.raises(WireError, match="cannot cross a stage boundary"):
        scalar_to_wire("v", value)


def test_scalar_without_kind_is_refused() -> None:
    with pytest.raises(WireError, match="no kind"):
        scalar_from_wire(pb.ScalarValue(name="v"), torch.device("cpu"))
    h = header()
    h.values.add(name="v")
    transfer = decode_transfer(iter([pb.TensorChunk(header=h)]), max_bytes=0)
    with pytest.raises(WireError, match="no kind"):
        transfer.scalars(torch.device("cpu"))


def test_unknown_dtype_name_is_refused() -> None:
    h = header()
    h.values.add(name="v", dtype_name="complex128")
    transfer = decode_transfer(iter([pb.TensorChunk(header=h)]), max_bytes=0)
    with pytest.raises(WireError, match="unknown dtype name"):
        transfer.scalars(torch.device("cpu"))


# ---------------------------------------------------------------- malformed streams
def _valid_chunks() -> list[pb.TensorChunk]:
    """Three chunks: 40 bytes of two tensors cut at 16 bytes."""
    return encode({"a": torch.arange(6, dtype=torch.float32), "b": torch.arange(2, dtype=torch.int64)}, chunk_bytes=16)


def _with_header(mutate: Callable[[pb.TransferHeader], None]) -> list[pb.TensorChunk]:
    chunks = _valid_chunks()
    mutate(chunks[0].header)
    return chunks


def _meta(h: pb.TransferHeader, **fields: object) -> None:
    meta = h.tensors[0]
    for name, value in fields.items():
        if name == "shape":
            del meta.shape[:]
            meta.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(meta, name, value)


def _drop_last(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    return chunks[:-1]


def _cut_last(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    chunks[-1].data = chunks[-1].data[:-1]
    return chunks


def _extra_chunk(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    return [*chunks, pb.TensorChunk(data=b"\x00")]


def _longer_last(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    chunks[-1].data += b"\x00"
    return chunks


def _header_again(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    chunks[1].header.CopyFrom(chunks[0].header)
    return chunks


def _empty_header_again(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    chunks[2].header.SetInParent()
    return chunks


def _no_header(chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    return chunks[1:]


def _duplicate_tensor(h: pb.TransferHeader) -> None:
    h.tensors.add().CopyFrom(h.tensors[0])


def _scalar_named_like_tensor(h: pb.TransferHeader) -> None:
    h.values.add(name="a", int_value=1)


def _duplicate_scalar(h: pb.TransferHeader) -> None:
    h.values.add(name="n", int_value=1)
    h.values.add(name="n", int_value=2)


MALFORMED: dict[str, tuple[Callable[[], list[pb.TensorChunk]], str]] = {
    "empty-stream": (lambda: [], "no chunk"),
    "first-chunk-without-header": (lambda: _no_header(_valid_chunks()), "must carry the header"),
    "header-repeated": (lambda: _header_again(_valid_chunks()), "only the first chunk"),
    "empty-header-in-later-chunk": (lambda: _empty_header_again(_valid_chunks()), "only the first chunk"),
    "truncated-missing-chunk": (lambda: _drop_last(_valid_chunks()), "ended after 32 of 40"),
    "truncated-short-chunk": (lambda: _cut_last(_valid_chunks()), "ended after 39 of 40"),
    "extra-chunk": (lambda: _extra_chunk(_valid_chunks()), "more than the 40 bytes"),
    "extra-bytes-in-last-chunk": (lambda: _longer_last(_valid_chunks()), "more than the 40 bytes"),
    "size-too-big-for-shape": (lambda: _with_header(lambda h: _meta(h, size_bytes=28)), "declares 28 bytes"),
    "size-too-small-for-shape": (lambda: _with_header(lambda h: _meta(h, size_bytes=20)), "declares 20 bytes"),
    "size-for-other-dtype": (lambda: _with_header(lambda h: _meta(h, dtype=pb.DTYPE_FLOAT64)), "need 48"),
    "negative-dim": (lambda: _with_header(lambda h: _meta(h, shape=[-6], size_bytes=24)), "invalid shape"),
    "negative-dims-cancel": (lambda: _with_header(lambda h: _meta(h, shape=[-2, -3], size_bytes=24)), "invalid shape"),
    "too-many-dims": (lambda: _with_header(lambda h: _meta(h, shape=[6] + [1] * MAX_DIMS)), "invalid shape"),
    "unknown-dtype-enum": (lambda: _with_header(lambda h: _meta(h, dtype=99)), "unknown wire dtype 99"),
    "unspecified-dtype": (lambda: _with_header(lambda h: _meta(h, dtype=pb.DTYPE_UNSPECIFIED)), "unknown wire dtype 0"),
    "duplicate-tensor-names": (lambda: _with_header(_duplicate_tensor), "appears twice"),
    "tensor-without-name": (lambda: _with_header(lambda h: _meta(h, name="")), "has no name"),
    "scalar-named-like-tensor": (lambda: _with_header(_scalar_named_like_tensor), "appears twice"),
    "duplicate-scalar-names": (lambda: _with_header(_duplicate_scalar), "appears twice"),
    "scalar-without-name": (lambda: _with_header(lambda h: h.values.add(int_value=1)), "no name"),
}


@pytest.mark.parametrize(("make_chunks", "match"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_streams_raise_wire_error(make_chunks: Callable[[], list[pb.TensorChunk]], match: str) -> None:
    # pytest.raises(WireError) lets any other exception type through, failing the test.
    with pytest.raises(WireError, match=match):
        decode_transfer(iter(make_chunks()), max_bytes=1 << 20)


def test_valid_chunks_are_valid() -> None:
    transfer = decode_transfer(iter(_valid_chunks()), max_bytes=40)
    assert torch.equal(transfer.tensors()["b"], torch.arange(2))


def test_transfer_above_max_bytes_is_refused() -> None:
    with pytest.raises(WireError, match="above the limit"):
        decode_transfer(iter(_valid_chunks()), max_bytes=39)


def _first_chunk_only(chunks: list[pb.TensorChunk]) -> Iterator[pb.TensorChunk]:
    yield chunks[0]
    raise AssertionError("the payload was read before the header was checked")


def test_size_limit_is_checked_before_the_payload_is_read() -> None:
    with pytest.raises(WireError, match="above the limit"):
        decode_transfer(_first_chunk_only(_valid_chunks()), max_bytes=10)


def test_header_is_checked_before_the_payload_is_read() -> None:
    chunks = _with_header(_duplicate_tensor)
    with pytest.raises(WireError, match="twice"):
        decode_transfer(_first_chunk_only(chunks), max_bytes=1 << 20)


def test_check_callback_refuses_before_the_payload_is_read() -> None:
    seen: list[list[str]] = []

    def check(h: pb.TransferHeader) -> None:
        seen.append([m.name for m in h.tensors])
        raise WireError("unexpected tensors for this stage")

    with pytest.raises(WireError, match="unexpected tensors for this stage"):
        decode_transfer(_first_chunk_only(_valid_chunks()), max_bytes=1 << 20, check=check)
    assert seen == [["a", "b"]]


def test_check_callback_may_raise_any_fusion_error() -> None:
    class Refused(FusionError):
        pass

    def check(_: pb.TransferHeader) -> None:
        raise Refused("stage not loaded")

    with pytest.raises(Refused):
        decode_transfer(_first_chunk_only(_valid_chunks()), max_bytes=1 << 20, check=check)


def test_check_callback_sees_a_valid_header_and_may_accept() -> None:
    calls: list[int] = []
    transfer = decode_transfer(iter(_valid_chunks()), max_bytes=40, check=lambda h: calls.append(len(h.tensors)))
    assert calls == [2]
    assert set(transfer.tensors()) == {"a", "b"}


def test_check_header_shape_returns_the_declared_size() -> None:
    assert check_header_shape(_valid_chunks()[0].header) == 40
    assert expected_raw_bytes(pb.TensorMeta(dtype=pb.DTYPE_BFLOAT16, shape=[3, 0])) == 0
    assert expected_raw_bytes(pb.TensorMeta(dtype=pb.DTYPE_BOOL, shape=[])) == 1


def test_encoded_tensor_without_decoder_is_refused() -> None:
    meta = pb.TensorMeta(name="c", dtype=pb.DTYPE_FLOAT32, shape=[4], size_bytes=3, codec=pb.CODEC_ZSTD)
    chunks = list(encode_transfer(header(), {}, encoded={"c": (meta, b"abc")}))
    transfer = decode_transfer(iter(chunks), max_bytes=3)
    assert bytes(transfer.raw("c")) == b"abc"
    with pytest.raises(WireError, match="no decoder"):
        transfer.tensors()
    decoded = transfer.tensors(decode=lambda m, raw: torch.full(tuple(m.shape), float(len(raw))))
    assert torch.equal(decoded["c"], torch.full((4,), 3.0))


def test_zero_element_shape_with_huge_dims_is_refused() -> None:
    h = header()
    h.tensors.add(name="t", dtype=pb.DTYPE_FLOAT32, shape=[0, 2**62, 2**62], size_bytes=0)
    with pytest.raises(WireError):
        transfer = decode_transfer(iter([pb.TensorChunk(header=h)]), max_bytes=1 << 20)
        transfer.tensors()


# ---------------------------------------------------------------- serialised (zero-copy) chunks
@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 1000])
def test_wire_chunks_are_protobuf_chunks(chunk_bytes: int) -> None:
    tensors = {"a": make_tensor((3, 5), torch.float32), "b": make_tensor((4,), torch.int64, seed=1)}
    values = {"n": 3, "size": (3, 5)}
    messages = encode(tensors, chunk_bytes=chunk_bytes, values=values)
    h = header()
    for name, value in values.items():
        h.values.append(scalar_to_wire(name, value))
    wire = list(encode_transfer_wire(h, tensors, chunk_bytes=chunk_bytes))
    assert wire == [m.SerializeToString() for m in messages], "hand-built bytes equal protobuf's"
    assert [pb.TensorChunk.FromString(w) for w in wire] == messages


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1000])
def test_parsed_wire_chunks_decode(chunk_bytes: int) -> None:
    tensors = {"a": make_tensor((3, 5), torch.bfloat16), "b": make_tensor((2, 3), torch.bool, seed=1)}
    raw_chunks = [parse_chunk(w) for w in encode_transfer_wire(header(), tensors, chunk_bytes=chunk_bytes)]
    assert all(isinstance(c, RawChunk) for c in raw_chunks)
    assert raw_chunks[0].header is not None and all(c.header is None for c in raw_chunks[1:])
    out = decode_transfer(iter(raw_chunks), max_bytes=1 << 20).tensors()
    for name, t in tensors.items():
        assert torch.equal(out[name], t)


def test_serialize_chunk_matches_protobuf_for_edge_cases() -> None:
    h = header()
    for chunk_header, data in [(None, b""), (None, b"x" * 300), (h, b""), (pb.TransferHeader(), b"ab")]:
        message = pb.TensorChunk(data=data) if chunk_header is None else pb.TensorChunk(header=chunk_header, data=data)
        assert serialize_chunk(chunk_header, data) == message.SerializeToString()
        parsed = parse_chunk(message.SerializeToString())
        assert bytes(parsed.data) == data
        assert (parsed.header is None) == (chunk_header is None)


def test_parse_chunk_skips_unknown_fields() -> None:
    unknown = b"\x18\x96\x01" + b"\x25\x00\x00\x00\x00" + b"\x29" + bytes(8) + b"\x3a\x02hi"  # fields 3, 4, 5, 7
    parsed = parse_chunk(unknown + serialize_chunk(None, b"data"))
    assert bytes(parsed.data) == b"data" and parsed.header is None


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12",  # data tag without a length
        b"\x12\x05abc",  # length past the end
        b"\x0a\x03\xff\xff\xff",  # header bytes that are not a TransferHeader
        b"\x12" + b"\xff" * 11,  # varint longer than 64 bits
        b"\x1b",  # start-group wire type
        b"\x1d\x00",  # truncated fixed32
        b"\x19\x00\x00",  # truncated fixed64
    ],
    ids=["no-length", "past-end", "bad-header", "long-varint", "group", "short-fixed32", "short-fixed64"],
)
def test_malformed_wire_chunks_raise_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError, match="malformed"):
        parse_chunk(raw)


@settings(max_examples=50, deadline=None)
@given(raw=st.binary(max_size=48))
def test_random_bytes_parse_or_raise_wire_error(raw: bytes) -> None:
    try:
        parsed = parse_chunk(raw)
    except WireError:
        return
    try:
        reference = pb.TensorChunk.FromString(raw)
    except DecodeError:
        return  # parse_chunk is more lenient on some corrupt input (e.g. field number 0)
    assert bytes(parsed.data) == reference.data
    assert (parsed.header is not None) == reference.HasField("header")


@settings(max_examples=50, deadline=None)
@given(cut=st.integers(min_value=0, max_value=200), flip=st.integers(min_value=0, max_value=255))
def test_corrupted_wire_transfers_decode_or_raise_wire_error(cut: int, flip: int) -> None:
    wire = list(encode_transfer_wire(header(), {"a": torch.arange(6.0), "b": torch.arange(2)}, chunk_bytes=16))
    first = bytearray(wire[0])
    first[cut % len(first)] ^= flip
    try:
        transfer = decode_transfer(iter([parse_chunk(bytes(first)), *map(parse_chunk, wire[1:])]), max_bytes=1 << 20)
        transfer.tensors()
        transfer.scalars(torch.device("cpu"))
    except WireError:
        pass


# ---------------------------------------------------------------- property test
_shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=4).map(tuple)
_tensor_specs = st.lists(st.tuples(_shapes, st.sampled_from(DTYPES), st.booleans()), min_size=1, max_size=4)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=_tensor_specs, chunk_bytes=st.integers(min_value=1, max_value=200), seed=st.integers(0, 2**16))
def test_random_transfers_round_trip(
    specs: list[tuple[tuple[int, ...], torch.dtype, bool]], chunk_bytes: int, seed: int
) -> None:
    tensors = {}
    for i, (shape, dtype, transpose) in enumerate(specs):
        t = make_tensor(shape, dtype, seed=seed + i)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, -1)  # non-contiguous
        tensors[f"t{i}"] = t
    round_trip(tensors, chunk_bytes=chunk_bytes)


@settings(max_examples=50, deadline=None)
@given(
    dtype=st.integers(min_value=-1, max_value=12),
    shape=st.lists(st.integers(min_value=-3, max_value=6), max_size=MAX_DIMS + 2),
    size_bytes=st.integers(min_value=0, max_value=400),
    data_len=st.integers(min_value=0, max_value=400),
)
def test_random_headers_decode_or_raise_wire_error(
    dtype: int, shape: list[int], size_bytes: int, data_len: int
) -> None:
    h = header()
    h.tensors.add(name="t", dtype=dtype, shape=shape, size_bytes=size_bytes)
    try:
        transfer = decode_transfer(iter([pb.TensorChunk(header=h, data=bytes(data_len))]), max_bytes=1 << 20)
        out = transfer.tensors()
    except WireError:
        return
    assert out["t"].shape == tuple(shape)
    assert out["t"].numel() * out["t"].element_size() == data_len == size_bytes
