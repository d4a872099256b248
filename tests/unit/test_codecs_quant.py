"""compress/quant.py and compress/topk_quant.py: round trips, the per-block error bound,
stochastic rounding (deterministic per seed, unbiased over seeds), refusal of malformed
bytes, and the executor's masked backward / error feedback with these codecs."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import zstandard

import compress.quant as quant_mod
import compress.topk_quant as tq_mod
from compress import get_compressor
from compress.topk import select_topk
from executor.compression import CutCompression, CutSetting
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2 as pb

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(0,), (1,), (7,), (127,), (128,), (129,), (4, 5, 3), (3, 300)]


def _round_trip(codec: str, t: torch.Tensor, **options: object) -> tuple[bytes, torch.Tensor]:
    c = get_compressor(codec)
    enc = c.encode(t, **options)
    return enc.data, c.decode(enc.data, dtype=t.dtype, shape=tuple(t.shape))


def _block_bound(x: torch.Tensor, bits: int, *, stochastic: bool = False) -> torch.Tensor:
    """Per-entry error bound: half a step (nearest) or one step (stochastic), step = absmax / q_max."""
    qmax = 2 ** (bits - 1) - 1
    flat = x.double().reshape(-1)
    nb = quant_mod.num_blocks(flat.numel(), quant_mod.BLOCK_SIZE)
    padded = torch.nn.functional.pad(flat, (0, nb * quant_mod.BLOCK_SIZE - flat.numel()))
    step = padded.view(nb, quant_mod.BLOCK_SIZE).abs().amax(dim=1) / qmax
    step = step.repeat_interleave(quant_mod.BLOCK_SIZE)[: flat.numel()]
    # float32 arithmetic (the division, the product) adds a few ulps of the block's absmax.
    slack = step * qmax * 4e-7
    return (step if stochastic else step / 2) + slack


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_round_trip_within_half_a_step_per_block(dtype: torch.dtype, shape: tuple[int, ...], bits: int) -> None:
    torch.manual_seed(0)
    t = (torch.randn(shape) * torch.logspace(-8, 3, max(1, math.prod(shape)))[: math.prod(shape)].view(shape)).to(dtype)
    data, back = _round_trip("quant", t, bits=bits)
    assert back.dtype == dtype and back.shape == t.shape
    n = t.numel()
    nb = quant_mod.num_blocks(n, quant_mod.BLOCK_SIZE)
    raw = zstandard.ZstdDecompressor().decompress(data)
    assert len(raw) == quant_mod.HEADER.size + 4 * nb + quant_mod.codes_bytes(n, bits)
    if dtype in (torch.float32, torch.float64):  # the output cast adds its own rounding otherwise
        err = (back.double() - t.double()).abs().reshape(-1)
        assert bool((err <= _block_bound(t.float(), bits)).all())


@pytest.mark.parametrize("seed", [None, 7])
def test_quant_4bit_sends_over_8x_fewer_bytes_than_float32(seed: int | None) -> None:
    """Gaussian entries round to about 3.3 bits of entropy at 4 bits (the module's
    derivation); zstd's Huffman stage must turn that into fewer than 1/8 of float32's bytes,
    scales included, and 8 bits must still save something."""
    torch.manual_seed(0)
    t = torch.randn(1 << 16)
    c = get_compressor("quant")
    assert len(c.encode(t, bits=4, seed=seed).data) * 8 < t.numel() * 4
    assert len(c.encode(t, bits=8, seed=seed).data) < quant_mod.HEADER.size + t.numel() * (1 + 4 / 128)


def test_quant_tiny_gradients_are_not_flushed_to_zero() -> None:
    t = torch.randn(1000) * 1e-12  # far below float16's smallest subnormal
    _, back = _round_trip("quant", t, bits=4)
    assert float((back - t).norm() / t.norm()) < 0.3


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_seeded_bounded_and_unbiased(bits: int) -> None:
    torch.manual_seed(1)
    t = torch.randn(300)
    c = get_compressor("quant")
    assert c.encode(t, bits=bits, seed=7).data == c.encode(t, bits=bits, seed=7).data
    assert c.encode(t, bits=bits, seed=7).data != c.encode(t, bits=bits, seed=8).data
    num_seeds = 2000
    total = torch.zeros(300, dtype=torch.float64)
    bound = _block_bound(t, bits, stochastic=True)
    for seed in range(num_seeds):
        back = c.decode(c.encode(t, bits=bits, seed=seed).data, dtype=torch.float32, shape=(300,))
        assert bool(((back - t).abs() <= bound).all())
        total += back.double()
    step = bound  # per-entry std of one rounding is at most step / 2
    # The mean over seeds is within 5 standard errors of the input (unbiased); nearest
    # rounding, biased by up to step / 2 on each entry, fails this for most entries.
    assert bool(((total / num_seeds - t.double()).abs() <= 5 * step / (2 * math.sqrt(num_seeds))).all())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
def test_topk_quant_keeps_topk_positions_with_bounded_values(ratio: float, bits: int) -> None:
    torch.manual_seed(2)
    t = torch.randn(17, 61)
    enc = get_compressor("topk-quant").encode(t, keep_ratio=ratio, bits=bits)
    back = get_compressor("topk-quant").decode(enc.data, dtype=t.dtype, shape=tuple(t.shape))
    idx, mask = select_topk(t.reshape(-1), math.ceil(ratio * t.numel() - 1e-6))
    assert torch.equal(enc.mask, mask)
    flat = back.reshape(-1)
    assert bool((flat[~mask] == 0).all())
    kept = t.reshape(-1)[idx]
    assert bool(((flat[idx] - kept).abs() <= _block_bound(kept, bits)).all())
    assert len(enc.data) < len(get_compressor("topk").encode(t, keep_ratio=ratio).data) or ratio >= 0.5


@pytest.mark.parametrize("codec", ["quant", "topk-quant"])
def test_encode_refuses_what_it_cannot_carry(codec: str) -> None:
    c = get_compressor(codec)
    with pytest.raises(CompressionError, match="NaN/Inf"):
        c.encode(torch.tensor([1.0, math.nan, 2.0]), keep_ratio=1.0)
    with pytest.raises(CompressionError, match="floating-point"):
        c.encode(torch.arange(10))
    for bits in (0, 2, 3, 16, True):
        with pytest.raises(ValueError, match="bits must be 4 or 8"):
            c.encode(torch.randn(10), bits=bits)


# ----------------------------------------------------------------- malformed payloads


def _quant_payload(numel: int = 300, bits: int = 8) -> bytes:
    """The decompressed payload, for mutating (:func:`_decode_quant` compresses it again)."""
    return zstandard.ZstdDecompressor().decompress(get_compressor("quant").encode(torch.randn(numel), bits=bits).data)


def _set_header(raw: bytes, **fields: int | bytes) -> bytes:
    magic, version, bits, block, numel = quant_mod.HEADER.unpack_from(raw)
    v = {"magic": magic, "version": version, "bits": bits, "block": block, "numel": numel, **fields}
    head = quant_mod.HEADER.pack(v["magic"], v["version"], v["bits"], v["block"], v["numel"])
    return head + raw[quant_mod.HEADER.size :]


def _decode_quant(raw: bytes, numel: int = 300) -> torch.Tensor:
    data = zstandard.ZstdCompressor(level=1).compress(raw)
    return get_compressor("quant").decode(data, dtype=torch.float32, shape=(numel,))


QUANT_CASES = {
    "empty": (lambda p: b"", "shorter than"),
    "truncated": (lambda p: p[:-1], "payload has"),
    "extended": (lambda p: p + b"\0", "payload has"),
    "bad magic": (lambda p: _set_header(p, magic=b"XXXX"), "bad magic"),
    "bad version": (lambda p: _set_header(p, version=9), "format version"),
    "bits 3": (lambda p: _set_header(p, bits=3), "3 bits"),
    "bits 16": (lambda p: _set_header(p, bits=16), "16 bits"),
    "block size 0": (lambda p: _set_header(p, block=0), "block size"),
    "block size huge": (lambda p: _set_header(p, block=65535), "block size"),
    "numel mismatch": (lambda p: _set_header(p, numel=301), "301 elements"),
    "numel huge": (lambda p: _set_header(p, numel=2**62), "elements"),
    "NaN scale": (lambda p: p[:16] + struct.pack("<f", math.nan) + p[20:], "scale is NaN"),
    "inf scale": (lambda p: p[:16] + struct.pack("<f", math.inf) + p[20:], "scale is NaN"),
    "negative scale": (lambda p: p[:16] + struct.pack("<f", -1.0) + p[20:], "negative"),
    "code -128": (lambda p: p[:-1] + b"\x80", "-128"),
}


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_quant_decode_refuses_malformed_payloads(case: str) -> None:
    mutate, message = QUANT_CASES[case]
    with pytest.raises(CompressionError, match=message):
        _decode_quant(mutate(_quant_payload()))


def test_quant_4bit_decode_refuses_codes_no_encoder_writes() -> None:
    p = _quant_payload(301, bits=4)
    with pytest.raises(CompressionError, match="padding nibble"):
        _decode_quant(p[:-1] + bytes([p[-1] | 0xF0]), 301)
    with pytest.raises(CompressionError, match="code 0"):
        _decode_quant(p[:-1] + bytes([p[-1] & 0xF0]), 301)


def test_quant_decode_refuses_wrong_target() -> None:
    p = get_compressor("quant").encode(torch.randn(300)).data
    with pytest.raises(CompressionError, match="floating-point"):
        get_compressor("quant").decode(p, dtype=torch.int32, shape=(300,))
    with pytest.raises(CompressionError, match="shape"):
        get_compressor("quant").decode(p, dtype=torch.float32, shape=(-1,))


def _tq(numel: int = 1000, ratio: float = 0.05) -> bytes:
    return zstandard.ZstdDecompressor().decompress(
        get_compressor("topk-quant").encode(torch.randn(numel), keep_ratio=ratio).data
    )


def _tq_header(raw: bytes, **fields: int | bytes) -> bytes:
    magic, version, kind, bits, k, numel = tq_mod.HEADER.unpack_from(raw)
    v = {"magic": magic, "version": version, "kind": kind, "bits": bits, "k": k, "numel": numel, **fields}
    head = tq_mod.HEADER.pack(v["magic"], v["version"], v["kind"], v["bits"], v["k"], v["numel"])
    return head + raw[tq_mod.HEADER.size :]


TQ_CASES = {
    "truncated": (lambda r: r[:-1], "payload has"),
    "bad magic": (lambda r: _tq_header(r, magic=b"FzTK"), "bad magic"),
    "bad version": (lambda r: _tq_header(r, version=2), "format version"),
    "unknown index kind": (lambda r: _tq_header(r, kind=9), "index kind"),
    "bits 5": (lambda r: _tq_header(r, bits=5), "5 bits"),
    "k over numel": (lambda r: _tq_header(r, k=1001), "k = 1001"),
    "k zero": (lambda r: _tq_header(r, k=0), "k = 0"),
    "numel mismatch": (lambda r: _tq_header(r, numel=999), "999 elements"),
    "index past the end": (
        lambda r: r[: tq_mod.HEADER.size] + b"\xff\x03" + r[tq_mod.HEADER.size + 2 :],
        "past the last element|repeat",
    ),
    "repeated index": (
        lambda r: r[: tq_mod.HEADER.size + 2] + b"\0\0" + r[tq_mod.HEADER.size + 4 :],
        "repeat",
    ),
}


@pytest.mark.parametrize("case", sorted(TQ_CASES))
def test_topk_quant_decode_refuses_malformed_payloads(case: str) -> None:
    mutate, message = TQ_CASES[case]
    raw = mutate(_tq())
    with pytest.raises(CompressionError, match=message):
        get_compressor("topk-quant").decode(
            zstandard.ZstdCompressor(level=1).compress(raw), dtype=torch.float32, shape=(1000,)
        )


@pytest.mark.parametrize("codec", ["quant", "topk-quant"])
def test_refuses_a_decompression_bomb_and_junk(codec: str) -> None:
    c = get_compressor(codec)
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (1 << 20))
    with pytest.raises(CompressionError, match="declares"):
        c.decode(bomb, dtype=torch.float32, shape=(1000,))
    with pytest.raises(CompressionError, match="not a zstd frame"):
        c.decode(b"junk bytes", dtype=torch.float32, shape=(1000,))


@pytest.mark.parametrize("codec", ["quant", "topk-quant"])
def test_random_corruption_raises_compression_error_or_decodes(codec: str) -> None:
    """Any flipped byte: a CompressionError or a tensor of the asked shape, nothing else."""
    c = get_compressor(codec)
    good = c.encode(torch.randn(500), keep_ratio=0.2, bits=4).data
    rng = np.random.default_rng(0)
    for _ in range(300):
        bad = bytearray(good)
        for pos in rng.integers(0, len(bad), size=int(rng.integers(1, 4))):
            bad[pos] = int(rng.integers(0, 256))
        try:
            out = c.decode(bytes(bad), dtype=torch.float32, shape=(500,))
        except CompressionError:
            continue
        assert out.shape == (500,)


# ----------------------------------------------------------------- on a stage's cuts


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_activation_backward_is_straight_through(bits: int) -> None:
    cc = CutCompression(0, {(0, 1): CutSetting(pb.CODEC_QUANT, bits=bits)})
    _, encoded, _ = cc.encode_activations(1, 0, {"h": torch.randn(4, 64)})
    assert encoded["h"][0].codec == pb.CODEC_QUANT
    grad = torch.randn(4, 64)
    assert torch.equal(cc.mask_gradient(1, 0, "h", grad), grad)


def test_topk_quant_activation_backward_is_masked() -> None:
    cc = CutCompression(0, {(0, 1): CutSetting(pb.CODEC_TOPK_QUANT, keep_ratio=0.25)})
    t = torch.randn(4, 64)
    _, encoded, _ = cc.encode_activations(1, 0, {"h": t})
    meta, data = encoded["h"]
    sent = get_compressor(meta.codec).decode(data, dtype=t.dtype, shape=tuple(t.shape))
    masked = cc.mask_gradient(1, 0, "h", torch.ones(4, 64))
    assert int(masked.sum()) == 64 and torch.equal(masked != 0, sent != 0)


@pytest.mark.parametrize(("codec", "bits"), [(pb.CODEC_QUANT, 4), (pb.CODEC_QUANT, 8), (pb.CODEC_TOPK_QUANT, 8)])
def test_quantized_gradients_keep_their_error_as_feedback(codec: int, bits: int) -> None:
    """Sum of what was sent plus the residual left = sum of the true gradients."""
    cc = CutCompression(1, {(0, 1): CutSetting(codec, keep_ratio=0.3, bits=bits)})
    torch.manual_seed(3)
    grads = [torch.randn(8, 32) for _ in range(6)]
    sent_total = torch.zeros(8, 32)
    for g in grads:
        _, encoded, _ = cc.encode_gradients(0, 0, {"h": g})
        meta, data = encoded["h"]
        sent_total += get_compressor(meta.codec).decode(data, dtype=torch.float32, shape=(8, 32))
    residual = cc.feedback.residual((0, 1, "h", 0))
    assert residual is not None and float(residual.abs().max()) > 0
    torch.testing.assert_close(sent_total + residual, sum(grads), rtol=1e-5, atol=1e-5)


def test_guard_settings_describe_received_codecs() -> None:
    cc = CutCompression(1, {(0, 1): CutSetting(pb.CODEC_QUANT, bits=4), (1, 2): CutSetting(pb.CODEC_TOPK, 0.1)})
    metas = [pb.TensorMeta(name="h", codec=pb.CODEC_QUANT), pb.TensorMeta(name="ids", codec=pb.CODEC_NONE)]
    got = cc.guard_settings(pb.TRANSFER_KIND_ACTIVATION, 0, metas)
    assert list(got) == ["h"] and got["h"].codec == "quant" and got["h"].bits == 4
    grads = cc.guard_settings(pb.TRANSFER_KIND_GRADIENT, 2, [pb.TensorMeta(name="g", codec=pb.CODEC_TOPK)])
    assert grads["g"].codec == "topk" and grads["g"].keep_ratio == 0.1
