"""Block quantization: every entry sent in 8 or 4 bits, with one scale per block.

The flattened tensor is cut into blocks of :data:`BLOCK_SIZE` entries (the last one may be
shorter). Block ``b`` with largest magnitude ``a_b`` gets the scale ``s_b = a_b / q_max``,
``q_max = 2**(bits - 1) - 1`` (127 or 7), and each entry ``x`` becomes the signed integer
``q = round(x / s_b)`` in ``[-q_max, q_max]`` (symmetric absmax quantization, as in
LLM.int8() and the 4-bit activations of AQ-SGD / TAH-Quant). Decoding gives ``q * s_b``.

Error bound. Round to nearest: ``|x - q s_b| <= s_b / 2 = a_b / (2 q_max)`` per entry
(``a_b / 254`` at 8 bits, ``a_b / 14`` at 4 bits). Stochastic rounding (a ``seed``):
``q = floor(x / s_b + u)``, ``u ~ U[0, 1)``, so ``E[q s_b] = x`` (unbiased; Gupta et al.,
"Deep Learning with Limited Numerical Precision", ICML 2015) and ``|x - q s_b| < s_b``.
Scales are float32: gradients are often far below float16's smallest normal (6e-5), where a
half-precision scale would round to zero and send nothing.

Wire format: one zstd frame (level 1, its content size declared) holding, little-endian::

    header   16 bytes  struct "<4sBBHQ": magic b"FzQB", format version, bits, block size, numel
    scales   4n bytes  n = ceil(numel / block size) float32 scales, finite and >= 0
    codes              bits 8: one int8 per entry, in [-127, 127];
                       bits 4: two entries per byte (low nibble first), each stored as
                       q + 8 in [1, 15]; an odd count pads the last high nibble with 0

Why zstd. The codes are not uniform over their range: a block's absmax is a few standard
deviations of its entries, so at 4 bits (``q_max = 7``) a roughly Gaussian block has
``sigma ~= 7 / 3`` levels and its rounded codes carry about
``log2(sigma * sqrt(2 pi e)) ~= 3.3`` bits of entropy, not 4; zstd's Huffman stage on the
literals (each byte a pair of nibbles) recovers most of the difference, which takes 4-bit
payloads past 8x fewer bytes than float32 (scales included). At 8 bits the same argument
gives about 7.4 bits, a smaller saving.

The decoder decompresses into at most the largest canonical payload, then checks every
field and the exact length before it allocates the output.
"""

from __future__ import annotations

import logging
import math
import struct

import torch

from compress.base import Compressor, Encoded, check_target, register, zstd_compress, zstd_decompress
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2

logger = logging.getLogger(__name__)

MAGIC = b"FzQB"
#: 2: the payload is a zstd frame (version 1 sent the sections raw).
FORMAT_VERSION = 2
#: magic, format version, bits, block size, numel.
HEADER = struct.Struct("<4sBBHQ")
#: Entries per scale: 128 keeps the scales at 3 % (8 bits) or 6 % (4 bits) of the codes and
#: the bound local enough that one outlier spoils only its block.
BLOCK_SIZE = 128
#: Block sizes a decoder accepts (an encoder may choose any of them).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 4096
#: Bits per entry the codecs support.
BITS = (4, 8)
SCALE_BYTES = 4


def check_bits(bits: object, *, codec: str) -> int:
    """``bits`` if it is 4 or 8.

    Raises:
        ValueError: any other value.
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"{codec}: bits must be 4 or 8, got {bits!r}")
    return int(bits)  # type: ignore[call-overload]


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks (scales) for ``numel`` entries."""
    return (numel + block_size - 1) // block_size


def codes_bytes(numel: int, bits: int) -> int:
    """Bytes of the packed codes of ``numel`` entries."""
    return numel if bits == 8 else (numel + 1) // 2


def quantize(
    flat: torch.Tensor, *, bits: int, block_size: int = BLOCK_SIZE, seed: int | None = None, codec: str = "quant"
) -> tuple[bytes, bytes]:
    """Scales and packed codes (the sections after the header) of a flat float tensor.

    Raises:
        CompressionError: a value is NaN or infinite (no finite scale can carry it).
    """
    x = flat.detach().to(device="cpu", dtype=torch.float32).reshape(-1)  # (numel,)
    numel = x.numel()
    if numel == 0:
        return b"", b""
    qmax = 2 ** (bits - 1) - 1
    nb = num_blocks(numel, block_size)
    blocks = torch.nn.functional.pad(x, (0, nb * block_size - numel)).view(nb, block_size)  # (nb, B)
    absmax = blocks.abs().amax(dim=1)  # (nb,); NaN and inf propagate into it
    if not bool(torch.isfinite(absmax).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise CompressionError(
            f"{codec}: the tensor has {bad} NaN/Inf value(s) of {numel}; quantization carries finite values only "
            "(the computation that produced it diverged)"
        )
    scales = absmax / qmax  # (nb,)
    # Round the scale up where float division rounded it down, so |x| / s <= q_max holds.
    scales = torch.where(scales * qmax < absmax, torch.nextafter(scales, torch.full_like(scales, math.inf)), scales)
    y = blocks * (1.0 / torch.where(scales > 0, scales, torch.ones_like(scales))).unsqueeze(1)  # (nb, B)
    if seed is None:
        y.round_()
    else:
        generator = torch.Generator().manual_seed(int(seed))
        y.add_(torch.rand(y.shape, generator=generator)).floor_()
    q = y.clamp_(-qmax, qmax).to(torch.int8).reshape(-1)[:numel]  # (numel,)
    if bits == 8:
        packed = q
    else:
        u = (q + 8).to(torch.uint8)  # [1, 15]
        if numel % 2:
            u = torch.cat((u, torch.zeros(1, dtype=torch.uint8)))
        packed = u[0::2] | (u[1::2] << 4)  # (ceil(numel / 2),)
    return scales.numpy().astype("<f4", copy=False).tobytes(), packed.numpy().tobytes()


def dequantize(
    raw: bytes | memoryview, offset: int, *, numel: int, bits: int, block_size: int, codec: str
) -> torch.Tensor:
    """float32 ``(numel,)`` from scales and codes at ``offset`` (length checked by the caller).

    Raises:
        CompressionError: a scale is NaN, infinite or negative, or a code is one no encoder
            writes (-128 at 8 bits, nibble 0 or a set padding nibble at 4 bits).
    """
    if numel == 0:
        return torch.empty(0)
    nb = num_blocks(numel, block_size)
    scales = torch.frombuffer(bytearray(raw[offset : offset + nb * SCALE_BYTES]), dtype=torch.float32)  # (nb,)
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CompressionError(f"{codec}: a block scale is NaN, infinite or negative; the payload is corrupt")
    start = offset + nb * SCALE_BYTES
    packed = torch.frombuffer(bytearray(raw[start : start + codes_bytes(numel, bits)]), dtype=torch.uint8)
    if bits == 8:
        q = packed.view(torch.int8)
        if bool((q == -128).any()):
            raise CompressionError(f"{codec}: code -128 is outside the symmetric range [-127, 127]")
    else:
        nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(-1)  # (2 * bytes,)
        if numel % 2 and int(nibbles[-1]) != 0:
            raise CompressionError(f"{codec}: the padding nibble after the last entry is not zero")
        nibbles = nibbles[:numel]
        if bool((nibbles == 0).any()):
            raise CompressionError(f"{codec}: 4-bit code 0 (-8) is outside the symmetric range [-7, 7]")
        q = nibbles.to(torch.int8) - 8
    q = torch.nn.functional.pad(q.to(torch.float32), (0, nb * block_size - numel)).view(nb, block_size)
    return (q * scales.unsqueeze(1)).reshape(-1)[:numel]  # (numel,)


def check_block_size(block_size: int, *, codec: str) -> None:
    """Raises:
    CompressionError: the header's block size is outside what any encoder uses."""
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise CompressionError(
            f"{codec}: block size {block_size} is outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]; the payload is corrupt"
        )


def parse_bits(bits: int, *, codec: str) -> int:
    """Raises:
    CompressionError: the header's bits are not 4 or 8."""
    if bits not in BITS:
        raise CompressionError(f"{codec}: {bits} bits per value; this build reads {BITS[0]} or {BITS[1]}")
    return bits


@register
class QuantCompressor(Compressor):
    """Every entry of a float tensor in 8 or 4 bits with a float32 scale per block."""

    codec = tensor_pb2.CODEC_QUANT
    name = "quant"
    lossless = False

    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """Quantize ``tensor`` to ``bits`` per entry (``keep_ratio`` is ignored).

        Raises:
            CompressionError: ``tensor`` is not floating point or holds NaN/Inf.
            ValueError: ``bits`` is not 4 or 8.
        """
        bits = check_bits(bits, codec=self.name)
        if not tensor.is_floating_point():
            raise CompressionError(
                f"quant encodes floating-point tensors only, got {tensor.dtype}; use 'none' or 'zstd'"
            )
        numel = tensor.numel()
        scales, codes = quantize(tensor.reshape(-1), bits=bits, seed=seed, codec=self.name)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, bits, BLOCK_SIZE, numel)
        payload = zstd_compress(b"".join((header, scales, codes)))
        return Encoded(self.codec, payload, numel * tensor.element_size())

    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A dense CPU tensor of ``dtype`` and ``shape``: each code times its block's scale."""
        numel = check_target(dtype, shape, codec=self.name)
        if not dtype.is_floating_point:
            raise CompressionError(f"quant: cannot decode into {dtype}; quant carries floating-point tensors only")
        # Largest canonical payload: the smallest blocks' scales and 8-bit codes.
        max_size = HEADER.size + num_blocks(numel, MIN_BLOCK_SIZE) * SCALE_BYTES + codes_bytes(numel, 8)
        view = memoryview(zstd_decompress(data, max_size_bytes=max_size, codec=self.name))
        if len(view) < HEADER.size:
            raise CompressionError(f"quant: payload of {len(view)} bytes is shorter than the {HEADER.size}-byte header")
        magic, version, bits, block_size, sent_numel = HEADER.unpack_from(view)
        if magic != MAGIC:
            raise CompressionError(f"quant: bad magic {magic!r} (expected {MAGIC!r}); the payload is not quantized")
        if version != FORMAT_VERSION:
            raise CompressionError(
                f"quant: format version {version}, this build reads {FORMAT_VERSION}; upgrade fusion on both ends"
            )
        parse_bits(bits, codec=self.name)
        check_block_size(block_size, codec=self.name)
        if sent_numel != numel:
            raise CompressionError(
                f"quant: payload is for {sent_numel} elements, but shape {tuple(shape)} has {numel}; "
                "the sender and receiver disagree on the tensor's shape"
            )
        expected = HEADER.size + num_blocks(numel, block_size) * SCALE_BYTES + codes_bytes(numel, bits)
        if len(view) != expected:
            raise CompressionError(
                f"quant: payload has {len(view)} bytes, {bits}-bit codes of {numel} entries need {expected}"
            )
        flat = dequantize(view, HEADER.size, numel=numel, bits=bits, block_size=block_size, codec=self.name)
        return flat.to(dtype).reshape(tuple(shape))
