"""compress/: codec round trips, top-k selection and sizes, error feedback, refusal of
malformed bytes, and the registry check (the AdaTopK controller: test_compress_controller.py)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import compress
import compress.topk as topk_mod
from compress import (
    REGISTRY,
    Compressor,
    Encoded,
    ErrorFeedback,
    check_registry,
    codec_value,
    get_compressor,
    num_kept,
    register,
    topk_encoded_size,
)
from compress.base import flat_bytes
from compress.topk import FORMAT_VERSION, HEADER, IndexKind, select_topk
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2 as pb

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (4, 5, 3)]
CODECS = ["none", "zstd", "fp16", "topk"]
MIB = 1 << 20


def sample(dtype: torch.dtype, shape: tuple[int, ...], *, special: bool = True) -> torch.Tensor:
    """Random values of ``dtype``; floats include inf, -inf, NaN and -0.0 when there is room."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, dtype=dtype)
        if special and dtype.is_floating_point and t.numel() >= 4:
            t.view(-1)[:4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0], dtype=dtype)
        return t
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape).to(dtype)


def round_trip(codec: str, t: torch.Tensor, keep_ratio: float = 1.0) -> tuple[Encoded, torch.Tensor]:
    c = get_compressor(codec)
    enc = c.encode(t, keep_ratio=keep_ratio)
    return enc, c.decode(enc.data, dtype=t.dtype, shape=tuple(t.shape))


def payload(enc: Encoded) -> bytes:
    """The top-k payload inside the zstd frame."""
    return zstandard.ZstdDecompressor().decompress(enc.data)


def repack(raw: bytes, **fields: int | bytes) -> bytes:
    """``raw`` with header fields replaced, zstd-compressed again."""
    magic, version, kind, k, numel = HEADER.unpack_from(raw)
    values = {"magic": magic, "version": version, "kind": kind, "k": k, "numel": numel, **fields}
    head = HEADER.pack(values["magic"], values["version"], values["kind"], values["k"], values["numel"])
    return zstandard.ZstdCompressor(level=1).compress(head + raw[HEADER.size :])


# ----------------------------------------------------------------- registry


def test_registry_has_every_codec() -> None:
    assert {c.name for c in REGISTRY.values()} == set(CODECS) | {"quant", "topk-quant"}
    for name, value in pb.Codec.items():
        if value != pb.CODEC_UNSPECIFIED:
            assert get_compressor(value).codec == value, name
    assert codec_value("topk") == pb.CODEC_TOPK
    assert get_compressor("zstd") is get_compressor(pb.CODEC_ZSTD)
    assert get_compressor(pb.CODEC_UNSPECIFIED).name == "none"  # tensor.proto: treated as CODEC_NONE
    assert [c.lossless for c in (get_compressor(n) for n in CODECS)] == [True, True, False, False]


@pytest.mark.parametrize("bad", ["gzip", 99, -1, None, True])
def test_unknown_codec_names_the_valid_ones(bad: object) -> None:
    with pytest.raises(CompressionError, match="'none'.*'zstd'.*'fp16'.*'topk'"):
        get_compressor(bad)  # type: ignore[arg-type]
    with pytest.raises(CompressionError):
        codec_value(bad)  # type: ignore[arg-type]


def test_check_registry_fails_when_a_codec_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    check_registry()
    monkeypatch.delitem(REGISTRY, pb.CODEC_TOPK)
    with pytest.raises(ImportError, match="CODEC_TOPK"):
        check_registry()


def test_check_registry_fails_for_a_new_enum_value(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pb.Codec.items()

    class FakeCodec:
        @staticmethod
        def items() -> list[tuple[str, int]]:
            return [*real, ("CODEC_FANCY", 17)]

    monkeypatch.setattr(pb, "Codec", FakeCodec)
    with pytest.raises(ImportError, match="CODEC_FANCY"):
        check_registry()


def test_register_refuses_bad_and_clashing_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compress.base, "REGISTRY", dict(REGISTRY))

    def make(codec: int, name: str) -> type[Compressor]:
        return type("Fake", (compress.NoneCompressor,), {"codec": codec, "name": name})

    with pytest.raises(ValueError, match="not a codec"):
        register(make(pb.CODEC_UNSPECIFIED, "fake"))
    with pytest.raises(ValueError, match="not a codec"):
        register(make(17, "fake"))
    with pytest.raises(ValueError, match="clashes"):
        register(make(pb.CODEC_NONE, "fake"))
    with pytest.raises(ValueError, match="clashes"):
        register(make(pb.CODEC_TOPK, "none"))


# ----------------------------------------------------------------- dense codecs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_lossless_round_trip(codec: str, dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = sample(dtype, shape)
        enc, back = round_trip(codec, t)
        assert enc.codec == codec_value(codec) and enc.mask is None
        assert enc.dense_bytes == t.numel() * t.element_size()
        assert back.dtype == dtype and back.shape == t.shape and back.device.type == "cpu"
        assert flat_bytes(back) == flat_bytes(t), (codec, dtype, shape)
    # Non-contiguous input, and a decoded tensor that owns writable memory.
    t = sample(dtype, (6, 5)).t()
    enc, back = round_trip(codec, t)
    assert flat_bytes(back) == flat_bytes(t)
    back.view(-1)[0] = back.view(-1)[1]
    if codec == "none":
        assert get_compressor(codec).decode(memoryview(enc.data), dtype=dtype, shape=(5, 6)).shape == (5, 6)


def test_zstd_compresses_structure() -> None:
    t = torch.zeros(10_000)
    t[::100] = 1.0
    enc, back = round_trip("zstd", t.requires_grad_())
    assert len(enc.data) < enc.dense_bytes / 20
    assert torch.equal(back, t.detach())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_fp16_error_bound(dtype: torch.dtype) -> None:
    t = (torch.randn(4096, dtype=torch.float64) * torch.logspace(-3, 3, 4096, dtype=torch.float64)).to(dtype)
    enc, back = round_trip("fp16", t)
    assert len(enc.data) == 2 * t.numel() and back.dtype == dtype
    # Round to nearest with 10 stored mantissa bits: relative error <= 2**-11 in the normal
    # range, absolute error <= 2**-25 among subnormals.
    err = (back.double() - t.double()).abs()
    assert bool((err <= 2.0**-11 * t.double().abs() + 2.0**-25).all())


def test_fp16_saturates_and_refuses_non_floats() -> None:
    t = torch.tensor([1e6, -1e6, math.inf, -math.inf, 1.0])
    _, back = round_trip("fp16", t)
    assert back.tolist() == [65504.0, -65504.0, math.inf, -math.inf, 1.0]
    _, nan = round_trip("fp16", torch.tensor([math.nan]))
    assert bool(nan.isnan().all())
    for dtype in (torch.int32, torch.bool, torch.complex64):
        with pytest.raises(CompressionError, match="floating-point"):
            get_compressor("fp16").encode(sample(dtype, (3,)))


# ----------------------------------------------------------------- top-k


@pytest.mark.parametrize("numel", [1, 10, 1000, 300_000])
@pytest.mark.parametrize("keep_ratio", [0.001, 0.05, 0.3, 1.0])
def test_topk_keeps_exactly_the_largest(numel: int, keep_ratio: float) -> None:
    t = torch.randn(numel) * torch.rand(numel).pow(4)
    enc, back = round_trip("topk", t.reshape(-1, 1) if numel % 2 else t, keep_ratio)
    back = back.reshape(-1)
    k = num_kept(numel, keep_ratio)
    assert k == max(1, math.ceil(keep_ratio * numel))
    mask = enc.mask
    assert mask is not None and mask.dtype == torch.bool and mask.shape == (numel,)
    assert int(mask.sum()) == k
    mag = t.abs()
    assert torch.equal(mag[mask].sort(descending=True).values, mag.sort(descending=True).values[:k])
    assert bool((back[~mask] == 0).all())
    assert bool(((back[mask] - t[mask]).abs() <= 2.0**-11 * t[mask].abs() + 2.0**-25).all())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_topk_dtypes_and_degenerate_shapes(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = sample(dtype, shape, special=False)
        enc, back = round_trip("topk", t, 0.5)
        assert back.dtype == dtype and back.shape == t.shape
        assert enc.mask is not None and enc.mask.shape == (t.numel(),)
        assert int(enc.mask.sum()) == num_kept(t.numel(), 0.5)
        assert torch.equal(back.reshape(-1)[enc.mask], t.reshape(-1)[enc.mask].half().to(dtype))


@pytest.mark.parametrize("sigmas", [topk_mod.BRACKET_SIGMAS, 0.0])
def test_select_topk_is_exact_on_large_and_adversarial_inputs(
    sigmas: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampled bracket (or its fallback when it misses) selects exactly the top k."""
    monkeypatch.setattr(topk_mod, "BRACKET_SIGMAS", sigmas)
    caplog.set_level(logging.DEBUG, logger="compress.topk")
    numel = topk_mod.EXACT_SELECT_NUMEL + 12_345
    cases = {
        "random": torch.randn(numel),
        "sorted": torch.arange(numel, dtype=torch.float32),
        "ties": torch.randint(0, 3, (numel,)).float(),
        "mostly zero": torch.zeros(numel).index_fill_(0, torch.randint(numel, (50,)), 1.0),
        **{str(dtype): torch.randn(numel, dtype=dtype) for dtype in (torch.float16, torch.bfloat16, torch.float64)},
    }
    for name, x in cases.items():
        for k in (1, 40, numel // 10, numel - 1):
            idx, mask = select_topk(x, k)
            assert idx.shape == (k,) and bool((idx[1:] > idx[:-1]).all()), name
            assert torch.equal(mask.nonzero().squeeze(1), idx), name
            mag = x.abs()
            assert torch.equal(mag[idx].sort().values, mag.sort().values[numel - k :]), (name, k)
    # A zero-width bracket misses on some of these inputs: the fallback was exercised.
    assert ("bracket missed" in caplog.text) == (sigmas == 0.0)


def test_topk_keeps_nan_and_inf_first() -> None:
    for numel in (1000, topk_mod.EXACT_SELECT_NUMEL * 2):  # torch.topk and the sampled bracket
        x = torch.randn(numel)
        x[[5, 77, 900]] = torch.tensor([math.nan, math.inf, -math.inf])
        idx, _ = select_topk(x, 3)
        assert idx.tolist() == [5, 77, 900]


@pytest.mark.parametrize("numel", [1_000, 10_000, 100_000, 1_000_000])
def test_topk_smaller_than_dense_and_estimate_is_an_upper_bound(numel: int) -> None:
    t = torch.randn(numel)
    for keep_ratio in (0.001, 0.01, 0.05, 0.1, 0.25, 0.5):
        enc = get_compressor("topk").encode(t, keep_ratio=keep_ratio)
        assert len(enc.data) < enc.dense_bytes, (numel, keep_ratio)
        k = num_kept(numel, keep_ratio)
        assert len(payload(enc)) <= topk_encoded_size(numel, k), (numel, keep_ratio)


def _index_kind(enc: Encoded) -> IndexKind:
    return IndexKind(HEADER.unpack_from(payload(enc))[2])


def _delta_bytes(mask: torch.Tensor) -> int:
    idx = mask.nonzero().squeeze(1).numpy()
    gap = int(np.diff(idx, prepend=0).max())
    return idx.size * next(w for w in (1, 2, 4) if gap < 2 ** (8 * w))


@pytest.mark.parametrize(
    ("keep_ratio", "kind"),
    [
        (0.0005, IndexKind.DELTA_U16),
        (0.002, IndexKind.DELTA_U16),
        (0.1, IndexKind.DELTA_U8),  # gaps < 256 bytes each: 1 byte per kept entry < numel / 8
        (0.2, IndexKind.BITMAP),
        (0.5, IndexKind.BITMAP),
    ],
)
def test_topk_picks_the_smaller_index_encoding(keep_ratio: float, kind: IndexKind) -> None:
    t = torch.randn(200_000)
    enc = get_compressor("topk").encode(t, keep_ratio=keep_ratio)
    assert _index_kind(enc) == kind
    assert enc.mask is not None
    bitmap_bytes, delta_bytes = (t.numel() + 7) // 8, _delta_bytes(enc.mask)
    k = num_kept(t.numel(), keep_ratio)
    assert len(payload(enc)) == HEADER.size + min(bitmap_bytes, delta_bytes) + 2 * k


def test_topk_narrow_and_wide_deltas() -> None:
    t = torch.zeros(100_000)
    t[50_000:50_100] = torch.rand(100) + 1  # one tight cluster: gaps of 1 after a far first index
    t[0] = 5.0
    enc, back = round_trip("topk", t, 101 / t.numel())
    assert _index_kind(enc) == IndexKind.DELTA_U16  # the first gap, 50,000, needs 16 bits
    assert torch.equal(back != 0, t != 0)
    t = torch.zeros(300)
    t[[3, 4, 250]] = 1.0
    assert _index_kind(round_trip("topk", t, 0.01)[0]) == IndexKind.DELTA_U8
    t = torch.zeros(20_000_000)
    t[[0, 19_999_999]] = 1.0
    enc, back = round_trip("topk", t, 2 / t.numel())
    assert _index_kind(enc) == IndexKind.DELTA_U32 and torch.equal(back, t)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, math.nan, True])
def test_topk_refuses_bad_ratio_and_dtype(bad: float) -> None:
    with pytest.raises(ValueError, match="keep_ratio"):
        get_compressor("topk").encode(torch.randn(10), keep_ratio=bad)
    with pytest.raises(CompressionError, match="floating-point"):
        get_compressor("topk").encode(torch.arange(10), keep_ratio=0.5)


# ----------------------------------------------------------------- error feedback


def test_error_feedback_sum_of_sent_tracks_sum_of_inputs() -> None:
    """Telescoping: sum(sent) = sum(inputs) - last residual, so the relative gap vanishes."""
    codec, fb, key = get_compressor("topk"), ErrorFeedback(), ("cut0", 0)
    g = torch.Generator().manual_seed(1)
    sum_in = torch.zeros(2000, dtype=torch.float64)
    sum_sent = torch.zeros_like(sum_in)
    sum_sent_without_feedback = torch.zeros_like(sum_in)
    rel: dict[int, float] = {}
    residual_norms = []
    for step in range(1, 401):
        grad = torch.randn(2000, generator=g) + 0.3
        comp = fb.compensate(key, grad)
        enc = codec.encode(comp, keep_ratio=0.1)
        sent = codec.decode(enc.data, dtype=grad.dtype, shape=(2000,))
        fb.update(key, comp, sent)
        plain = codec.encode(grad, keep_ratio=0.1)
        sum_sent_without_feedback += codec.decode(plain.data, dtype=grad.dtype, shape=(2000,)).double()
        sum_in += grad.double()
        sum_sent += sent.double()
        residual = fb.residual(key)
        assert residual is not None
        residual_norms.append(float(residual.norm()))
        torch.testing.assert_close(sum_in - sum_sent, residual.double(), atol=1e-3, rtol=1e-4)
        rel[step] = float((sum_in - sum_sent).norm() / sum_in.norm())
    assert max(residual_norms[200:]) < 2 * max(residual_norms[:200])  # the residual stays bounded
    assert rel[400] < rel[40] / 4 and rel[400] < 0.1
    assert float((sum_in - sum_sent_without_feedback).norm() / sum_in.norm()) > 0.5  # what feedback fixes


def test_error_feedback_api() -> None:
    fb = ErrorFeedback()
    grad = torch.randn(3, 4)
    assert fb.compensate((0, 1), grad) is grad and len(fb) == 0
    fb.update((0, 1), grad, torch.zeros(3, 4))
    torch.testing.assert_close(fb.compensate((0, 1), grad), 2 * grad)
    with pytest.raises(ValueError, match="shape"):
        fb.compensate((0, 1), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="shape"):
        fb.update((0, 1), grad, torch.zeros(12))
    w = torch.randn(2, requires_grad=True)
    fb.update("w", w * 2, torch.zeros(2))
    assert not fb.state_dict()["'w'"].requires_grad

    state = fb.state_dict()
    assert set(state) == {"(0, 1)", "'w'"}
    other = ErrorFeedback()
    other.load_state_dict(state)
    torch.testing.assert_close(other.compensate((0, 1), grad), 2 * grad)
    assert len(other) == 2
    other.clear()
    assert len(other) == 0 and other.compensate((0, 1), grad) is grad
    with pytest.raises(ValueError, match="str to tensors"):
        other.load_state_dict({(0, 1): torch.zeros(1)})  # type: ignore[dict-item]


# ----------------------------------------------------------------- malformed input

GOOD = torch.randn(4, 5, 6)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_or_padded_bytes_are_refused(codec: str) -> None:
    c = get_compressor(codec)
    data = c.encode(GOOD, keep_ratio=0.2).data
    for cut in sorted({0, 1, 5, len(data) // 2, len(data) - 1}):
        with pytest.raises(CompressionError):
            c.decode(data[:cut], dtype=GOOD.dtype, shape=tuple(GOOD.shape))
    with pytest.raises(CompressionError):
        c.decode(data + b"\0", dtype=GOOD.dtype, shape=tuple(GOOD.shape))


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_shape_or_dtype_is_refused(codec: str) -> None:
    c = get_compressor(codec)
    data = c.encode(GOOD, keep_ratio=0.2).data
    for dtype, shape in [
        (GOOD.dtype, (4, 5, 7)),
        (GOOD.dtype, (4, 5)),
        (GOOD.dtype, (0,)),
        (GOOD.dtype, (4, -5, -6)),
        (GOOD.dtype, (4, 5, 6.0)),
        (GOOD.dtype, (0, 2**70)),
        (GOOD.dtype, (2**40, 2**40)),
        (GOOD.dtype, None),
        ("float32", (4, 5, 6)),
        (torch.float64, (4, 5, 6)) if codec in ("none", "zstd") else (torch.int32, (4, 5, 6)),
    ]:
        with pytest.raises(CompressionError):
            c.decode(data, dtype=dtype, shape=shape)  # type: ignore[arg-type]
    with pytest.raises(CompressionError):
        c.decode("not bytes", dtype=GOOD.dtype, shape=tuple(GOOD.shape))  # type: ignore[arg-type]
    back = c.decode(memoryview(data), dtype=GOOD.dtype, shape=tuple(GOOD.shape))
    assert back.shape == GOOD.shape


def _topk_raw(t: torch.Tensor, keep_ratio: float) -> bytes:
    return payload(get_compressor("topk").encode(t, keep_ratio=keep_ratio))


def _decode_topk(blob: bytes, numel: int) -> torch.Tensor:
    return get_compressor("topk").decode(blob, dtype=torch.float32, shape=(numel,))


def test_topk_header_fields_are_checked() -> None:
    numel = 1003  # not a multiple of 8: the bitmap has padding bits
    raw = _topk_raw(torch.randn(numel), 0.5)
    assert HEADER.unpack_from(raw)[2] == IndexKind.BITMAP
    _decode_topk(repack(raw), numel)  # the repacking itself is sound
    k = HEADER.unpack_from(raw)[3]
    for fields, message in [
        ({"magic": b"XXXX"}, "magic"),
        ({"version": FORMAT_VERSION + 1}, "version"),
        ({"kind": 0}, "index kind"),
        ({"kind": 9}, "index kind"),
        ({"numel": numel + 1}, "elements"),
        ({"k": 0}, "k = 0"),
        ({"k": numel + 1}, "k = "),
        ({"k": 2**64 - 1}, "k = "),
        ({"k": k - 1}, "payload has"),
        ({"kind": IndexKind.DELTA_U8}, "more than a"),
    ]:
        with pytest.raises(CompressionError, match=message):
            _decode_topk(repack(raw, **fields), numel)
    with pytest.raises(CompressionError, match="shorter than"):
        _decode_topk(zstandard.ZstdCompressor().compress(raw[:10]), numel)


def test_topk_bitmap_is_checked() -> None:
    numel = 1003
    raw = bytearray(_topk_raw(torch.randn(numel), 0.5))
    bitmap_end = HEADER.size + (numel + 7) // 8
    padded = bytearray(raw)
    padded[bitmap_end - 1] |= 0x01  # a padding bit (bits past numel are the last byte's low bits)
    with pytest.raises(CompressionError, match="padding"):
        _decode_topk(repack(bytes(padded)), numel)
    flipped = bytearray(raw)
    flipped[HEADER.size] ^= 0x80  # one position more or less
    with pytest.raises(CompressionError, match="bitmap keeps"):
        _decode_topk(repack(bytes(flipped)), numel)


def test_topk_deltas_are_checked() -> None:
    numel = 100_000
    raw = _topk_raw(torch.randn(numel), 0.001)
    kind, k = HEADER.unpack_from(raw)[2:4]
    assert kind == IndexKind.DELTA_U16
    deltas = np.frombuffer(raw, "<u2", count=k, offset=HEADER.size).copy()
    values = raw[HEADER.size + 2 * k :]
    head = raw[: HEADER.size]

    def with_deltas(d: np.ndarray) -> bytes:
        return zstandard.ZstdCompressor().compress(head + d.astype("<u2").tobytes() + values)

    _decode_topk(with_deltas(deltas), numel)
    repeat = deltas.copy()
    repeat[5] = 0
    with pytest.raises(CompressionError, match="repeat"):
        _decode_topk(with_deltas(repeat), numel)
    past = deltas.copy()
    past[-1] += numel - int(deltas.astype(np.int64).sum())
    with pytest.raises(CompressionError, match="past the last"):
        _decode_topk(with_deltas(past), numel)
    first = deltas.copy()  # a zero first gap is position 0: valid
    first[1] += first[0]
    first[0] = 0
    assert _decode_topk(with_deltas(first), numel).nonzero().squeeze(1)[0] == 0


@pytest.mark.parametrize("codec", ["zstd", "topk"])
def test_decompression_bombs_are_refused(codec: str) -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(64 * MIB))
    assert len(bomb) < 64 * 1024
    with pytest.raises(CompressionError, match="declares"):
        get_compressor(codec).decode(bomb, dtype=torch.float32, shape=(1000,))
    hidden = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 * MIB))
    for shape in [(1000,), (2**40,)]:  # a huge expected size must not be allocated up front
        with pytest.raises(CompressionError, match="does not declare"):
            get_compressor(codec).decode(hidden, dtype=torch.float32, shape=shape)


DECODE_TARGETS = st.tuples(
    st.sampled_from(CODECS),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
    st.sampled_from([(), (0,), (1,), (3,), (2, 5), (17,), (64,)]),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(target=DECODE_TARGETS, data=st.binary(max_size=300), wrap=st.booleans())
def test_random_bytes_raise_only_compression_errors(
    target: tuple[str, torch.dtype, tuple[int, ...]], data: bytes, wrap: bool
) -> None:
    """Random bytes, raw or inside a valid zstd frame (to reach the top-k header checks)."""
    codec, dtype, shape = target
    blob = zstandard.ZstdCompressor().compress(data) if wrap else data
    try:
        out = get_compressor(codec).decode(blob, dtype=dtype, shape=shape)
    except CompressionError:
        return
    assert out.dtype == dtype and tuple(out.shape) == shape


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    numel=st.integers(0, 200),
    keep_ratio=st.floats(0.001, 1.0),
    position=st.integers(0, 10_000),
    xor=st.integers(1, 255),
)
def test_flipped_topk_payload_bytes_raise_only_compression_errors(
    numel: int, keep_ratio: float, position: int, xor: int
) -> None:
    raw = bytearray(_topk_raw(torch.randn(numel), keep_ratio))
    raw[position % len(raw)] ^= xor
    try:
        out = _decode_topk(zstandard.ZstdCompressor().compress(bytes(raw)), numel)
    except CompressionError:
        return
    assert out.shape == (numel,)  # a flipped value byte is still a well-formed payload
