"""Tensor codecs for the wire, error feedback, and the AdaTopK ratio controller.

Importing this package registers every codec and checks that each value of the wire enum
:class:`fusion.wire.tensor_pb2.Codec` has one (``ImportError`` otherwise).

    enc = get_compressor("topk").encode(t, keep_ratio=0.05)
    t2 = get_compressor(enc.codec).decode(enc.data, dtype=t.dtype, shape=tuple(t.shape))
"""

from __future__ import annotations

from compress import dense, quant, topk, topk_quant  # noqa: F401  (registers the codecs)
from compress.base import REGISTRY, Compressor, Encoded, check_registry, codec_value, get_compressor, register
from compress.controller import AdaTopK
from compress.dense import Fp16Compressor, NoneCompressor, ZstdCompressor
from compress.feedback import ErrorFeedback
from compress.quant import QuantCompressor
from compress.topk import TopKCompressor, num_kept, topk_encoded_size
from compress.topk_quant import TopKQuantCompressor

check_registry()

__all__ = [
    "REGISTRY",
    "AdaTopK",
    "Compressor",
    "Encoded",
    "ErrorFeedback",
    "Fp16Compressor",
    "NoneCompressor",
    "QuantCompressor",
    "TopKCompressor",
    "TopKQuantCompressor",
    "ZstdCompressor",
    "check_registry",
    "codec_value",
    "get_compressor",
    "num_kept",
    "register",
    "topk_encoded_size",
]
