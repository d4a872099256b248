"""Dense codecs: every entry is sent.

- ``none``: the raw bytes, for fast links and for tensors that do not compress.
- ``zstd``: the raw bytes through zstd level 1; lossless, any dtype. Pays off on tensors
  with structure (masks, integer ids, activations after ReLU); on random floats it saves
  little, and a link must be slow for it to save more time than it costs.
- ``fp16``: floats rounded to half precision; halves fp32 traffic with a relative error of
  at most 2**-11 per entry (round-to-nearest, 10 stored mantissa bits) inside fp16's range.

Bytes are in the machine's native order; every platform fusion runs on is little-endian.
"""

from __future__ import annotations

import logging

import torch

from compress.base import (
    Compressor,
    Encoded,
    as_byte_view,
    check_target,
    flat_bytes,
    register,
    tensor_from_bytes,
    zstd_compress,
    zstd_decompress,
)
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2

logger = logging.getLogger(__name__)

#: Largest finite float16.
FP16_MAX = 65504.0


def _dense_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def to_half_saturating(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float16, with finite values beyond fp16's range clamped to +-65504.

    A plain cast turns them into inf, which the receiver would reject as a poisoned update;
    inf and NaN inputs stay what they are.
    """
    half = x.to(torch.float16)
    overflow = torch.isinf(half) & torch.isfinite(x)
    if bool(overflow.any()):
        half = torch.where(overflow, torch.sign(x).to(torch.float16) * FP16_MAX, half)
    return half


def _check_length(view: memoryview, expected: int, *, codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if len(view) != expected:
        raise CompressionError(
            f"{codec}: payload has {len(view)} bytes, a {dtype} tensor of shape {tuple(shape)} needs {expected}; "
            "the sender and receiver disagree on the tensor's dtype or shape"
        )


@register
class NoneCompressor(Compressor):
    """Raw bytes, as stored."""

    codec = tensor_pb2.CODEC_NONE
    name = "none"
    lossless = True

    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """Raw bytes of ``tensor``; the options are ignored."""
        return Encoded(self.codec, flat_bytes(tensor), _dense_bytes(tensor))

    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor whose raw bytes are ``data``."""
        numel = check_target(dtype, shape, codec=self.name)
        view = as_byte_view(data)
        _check_length(view, numel * dtype.itemsize, codec=self.name, dtype=dtype, shape=shape)
        return tensor_from_bytes(view, dtype=dtype, shape=tuple(shape))


@register
class ZstdCompressor(Compressor):
    """Raw bytes through zstd level 1: lossless, any dtype."""

    codec = tensor_pb2.CODEC_ZSTD
    name = "zstd"
    lossless = True

    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """zstd of the raw bytes; the options are ignored."""
        return Encoded(self.codec, zstd_compress(flat_bytes(tensor)), _dense_bytes(tensor))

    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Decompress (into at most the expected size) and reinterpret."""
        numel = check_target(dtype, shape, codec=self.name)
        expected = numel * dtype.itemsize
        raw = zstd_decompress(data, max_size_bytes=expected, codec=self.name)
        _check_length(memoryview(raw), expected, codec=self.name, dtype=dtype, shape=shape)
        return tensor_from_bytes(raw, dtype=dtype, shape=tuple(shape))


@register
class Fp16Compressor(Compressor):
    """Floats in half precision (lossy); other dtypes are refused."""

    codec = tensor_pb2.CODEC_FP16
    name = "fp16"
    lossless = False

    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """float16 bytes of ``tensor`` (saturating, see :func:`to_half_saturating`); the options are ignored.

        Raises:
            CompressionError: ``tensor`` is not floating point.
        """
        if not tensor.is_floating_point():
            raise CompressionError(
                f"fp16 encodes floating-point tensors only, got {tensor.dtype}; use 'none' or 'zstd'"
            )
        return Encoded(self.codec, flat_bytes(to_half_saturating(tensor.detach())), _dense_bytes(tensor))

    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """float16 bytes, cast to ``dtype``."""
        numel = check_target(dtype, shape, codec=self.name)
        if not dtype.is_floating_point:
            raise CompressionError(f"fp16: cannot decode into {dtype}; fp16 carries floating-point tensors only")
        view = as_byte_view(data)
        _check_length(view, numel * 2, codec=self.name, dtype=dtype, shape=shape)
        return tensor_from_bytes(view, dtype=torch.float16, shape=tuple(shape)).to(dtype)
