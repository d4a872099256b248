"""Top-k with quantized values: the ``k`` largest magnitudes, each in 8 (or 4) bits.

Selection and index section are those of :mod:`compress.topk`; the kept values, in index
order, are block-quantized as in :mod:`compress.quant` (float32 scale per block of
:data:`~compress.quant.BLOCK_SIZE` kept values). A kept value ``x`` in block ``b`` is
decoded within ``a_b / (2 q_max)`` of itself (``a_b`` the block's largest kept magnitude),
and dropped entries are zero, as for top-k. Against top-k's float16 values this sends about
half the value bytes at 8 bits.

Wire format (one zstd level-1 frame; little-endian)::

    header   24 bytes  struct "<4sBBBxQQ": magic b"FzTQ", format version, index kind, bits, k, numel
    indices            as in compress/topk.py
    scales   4n bytes  n = ceil(k / BLOCK_SIZE) float32 scales
    codes              as in compress/quant.py, for the k kept values
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import torch

from compress.base import Compressor, Encoded, check_target, register, zstd_compress, zstd_decompress
from compress.quant import (
    BLOCK_SIZE,
    SCALE_BYTES,
    check_bits,
    codes_bytes,
    dequantize,
    num_blocks,
    parse_bits,
    quantize,
)
from compress.topk import (
    IndexKind,
    _bitmap_bytes,
    decode_indices,
    encode_indices,
    index_section_bytes,
    num_kept,
    select_topk,
)
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2

logger = logging.getLogger(__name__)

MAGIC = b"FzTQ"
FORMAT_VERSION = 1
#: magic, format version, index kind, bits, pad byte, k, numel.
HEADER = struct.Struct("<4sBBBxQQ")


@register
class TopKQuantCompressor(Compressor):
    """Keep the ``k`` largest-magnitude entries of a float tensor, quantized to ``bits``."""

    codec = tensor_pb2.CODEC_TOPK_QUANT
    name = "topk-quant"
    lossless = False

    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """Sparsify ``tensor`` to ``num_kept(numel, keep_ratio)`` entries and quantize them.

        ``Encoded.mask`` is the kept positions, a flat bool ``(numel,)`` on ``tensor``'s device.

        Raises:
            CompressionError: ``tensor`` is not floating point, or a kept value is NaN/Inf.
            ValueError: ``keep_ratio`` is not in ``(0, 1]`` or ``bits`` is not 4 or 8.
        """
        bits = check_bits(bits, codec=self.name)
        if not tensor.is_floating_point():
            raise CompressionError(
                f"topk-quant encodes floating-point tensors only, got {tensor.dtype}; use 'none' or 'zstd'"
            )
        numel = tensor.numel()
        k = num_kept(numel, keep_ratio)
        flat = tensor.detach().reshape(-1)  # (numel,)
        idx, mask = select_topk(flat, k)
        scales, codes = quantize(flat[idx], bits=bits, seed=seed, codec=self.name)  # (k,) in index order
        kind, index_section = encode_indices(idx, mask)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, kind, bits, k, numel)
        payload = b"".join((header, index_section, scales, codes))
        return Encoded(self.codec, zstd_compress(payload), numel * tensor.element_size(), mask)

    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A dense CPU tensor of ``dtype`` and ``shape``: the kept values, zeros elsewhere."""
        numel = check_target(dtype, shape, codec=self.name)
        if not dtype.is_floating_point:
            raise CompressionError(f"topk-quant: cannot decode into {dtype}; it carries floating-point tensors only")
        # Largest canonical payload: a bitmap, numel scales (blocks of 1 at most) and 8-bit codes.
        max_size = HEADER.size + _bitmap_bytes(numel) + (SCALE_BYTES + 1) * numel
        raw = zstd_decompress(data, max_size_bytes=max_size, codec=self.name)
        if len(raw) < HEADER.size:
            raise CompressionError(
                f"topk-quant: payload of {len(raw)} bytes is shorter than the {HEADER.size}-byte header"
            )
        magic, version, kind_value, bits, k, sent_numel = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise CompressionError(f"topk-quant: bad magic {magic!r} (expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise CompressionError(
                f"topk-quant: format version {version}, this build reads {FORMAT_VERSION}; upgrade fusion on both ends"
            )
        try:
            kind = IndexKind(kind_value)
        except ValueError:
            raise CompressionError(
                f"topk-quant: unknown index kind {kind_value}; valid are {[int(v) for v in IndexKind]}"
            ) from None
        parse_bits(bits, codec=self.name)
        if sent_numel != numel:
            raise CompressionError(
                f"topk-quant: payload is for {sent_numel} elements, but shape {tuple(shape)} has {numel}; "
                "the sender and receiver disagree on the tensor's shape"
            )
        if k > numel or (k == 0 and numel > 0):
            raise CompressionError(f"topk-quant: k = {k} is not in [1, {numel}]")
        index_bytes = index_section_bytes(kind, k, numel, codec=self.name)
        expected = HEADER.size + index_bytes + num_blocks(k, BLOCK_SIZE) * SCALE_BYTES + codes_bytes(k, bits)
        if len(raw) != expected:
            raise CompressionError(
                f"topk-quant: payload has {len(raw)} bytes, {kind.name} indices and {bits}-bit values for "
                f"k = {k} of {numel} need {expected}"
            )
        idx = decode_indices(raw, HEADER.size, kind, k, numel, codec=self.name)
        values = dequantize(
            raw, HEADER.size + index_bytes, numel=k, bits=bits, block_size=BLOCK_SIZE, codec=self.name
        )  # (k,)
        out = torch.zeros(numel, dtype=dtype)
        if k > 0:
            out[torch.from_numpy(np.ascontiguousarray(idx))] = values.to(dtype)
        return out.reshape(tuple(shape))
