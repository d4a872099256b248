"""The compressor interface and the codec registry.

A codec turns a tensor into bytes for the wire and back. Each one is registered under the
value of the wire enum :class:`fusion.wire.tensor_pb2.Codec` that names it, so a received
``TensorMeta.codec`` finds its decoder with :func:`get_compressor`. Importing
:mod:`compress` fails if an enum value has no codec (:func:`check_registry`), the way
hivemind's ``compression/serialization.py`` checks its ``CompressionType`` table: a codec
added to ``proto/`` without an implementation is caught at import, not by the first peer
that uses it.

Decoders read bytes from strangers. They raise :class:`~fusion.errors.CompressionError`
on any malformed input and nothing else, never read or allocate more than the tensor the
caller expects, and never unpickle.
"""

from __future__ import annotations

import abc
import logging
import math
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
import zstandard

from fusion.errors import CompressionError
from fusion.wire import tensor_pb2

logger = logging.getLogger(__name__)

#: zstd level for every codec that uses it: level 1 compresses at several hundred MB/s per
#: core, and higher levels gain little on float payloads (mostly high-entropy mantissas).
ZSTD_LEVEL = 1


@dataclass(frozen=True)
class Encoded:
    """One tensor, encoded for the wire."""

    codec: int
    """The :class:`fusion.wire.tensor_pb2.Codec` value that decodes ``data``."""
    data: bytes
    """What goes on the wire."""
    dense_bytes: int
    """``numel * element_size`` of the input: what sending it uncompressed would cost."""
    mask: torch.Tensor | None = None
    """Top-k only: flat bool ``(numel,)`` of the kept positions, on the input's device
    (backward through a sparsified activation passes gradient only there)."""

    @property
    def size_bytes(self) -> int:
        """Bytes on the wire."""
        return len(self.data)


class Compressor(abc.ABC):
    """A stateless codec: ``decode(encode(t).data, dtype=t.dtype, shape=t.shape)`` gives
    ``t`` back exactly when :attr:`lossless`, an approximation otherwise."""

    codec: ClassVar[int]
    """The wire enum value this codec is registered under."""
    name: ClassVar[str]
    """Short name used in plans (``"none"``, ``"zstd"``, ``"fp16"``, ``"topk"``, ``"quant"``, ``"topk-quant"``)."""
    lossless: ClassVar[bool]
    """Whether decoding gives back the input bit for bit."""

    @abc.abstractmethod
    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """Encode ``tensor`` (any device; it is not modified).

        Args:
            tensor: the tensor to send.
            keep_ratio: fraction of entries to keep, in ``(0, 1]``; only sparsifying codecs
                look at it.
            bits: bits per value, 4 or 8; only quantizing codecs look at it.
            seed: quantizing codecs round stochastically (unbiased) with this seed, and to
                nearest when it is None; the same seed gives the same bytes.

        Raises:
            CompressionError: the codec cannot encode this dtype (or these values).
            ValueError: ``keep_ratio`` or ``bits`` is out of range.
        """

    @abc.abstractmethod
    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Decode wire bytes into a new CPU tensor of ``dtype`` and ``shape``.

        Raises:
            CompressionError: ``data`` is malformed or does not describe a tensor of
                ``dtype`` and ``shape``; never any other exception.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, codec={self.codec})"


#: Codec enum value -> the registered compressor instance.
REGISTRY: dict[int, Compressor] = {}

C = TypeVar("C", bound=type[Compressor])


def register(cls: C) -> C:
    """Class decorator: register an instance of ``cls`` under ``cls.codec``.

    Raises:
        ValueError: the codec value is not in the wire enum, is ``CODEC_UNSPECIFIED``, or is
            already taken by another class (or the name is).
    """
    valid = dict(tensor_pb2.Codec.items())
    if cls.codec not in valid.values() or cls.codec == tensor_pb2.CODEC_UNSPECIFIED:
        raise ValueError(f"{cls.__qualname__}.codec = {cls.codec!r} is not a codec of the wire enum Codec {valid}")
    for other in REGISTRY.values():
        same_class = type(other).__module__ == cls.__module__ and type(other).__qualname__ == cls.__qualname__
        if not same_class and (other.codec == cls.codec or other.name == cls.name):
            raise ValueError(
                f"{cls.__qualname__} (codec {cls.codec}, name {cls.name!r}) clashes with registered {other!r}"
            )
    REGISTRY[cls.codec] = cls()
    return cls


def _valid_names() -> str:
    return ", ".join(f"{c.name!r} ({c.codec})" for c in sorted(REGISTRY.values(), key=lambda c: c.codec))


def get_compressor(codec: int | str) -> Compressor:
    """The compressor for a wire enum value or a name.

    ``CODEC_UNSPECIFIED`` (0, a message that does not set the field) means ``CODEC_NONE``, as
    ``tensor.proto`` documents.

    Raises:
        CompressionError: no codec has this value or name (the message lists the valid ones).
    """
    if isinstance(codec, str):
        for compressor in REGISTRY.values():
            if compressor.name == codec:
                return compressor
    elif isinstance(codec, int) and not isinstance(codec, bool):
        found = REGISTRY.get(tensor_pb2.CODEC_NONE if codec == tensor_pb2.CODEC_UNSPECIFIED else codec)
        if found is not None:
            return found
    raise CompressionError(f"unknown codec {codec!r}; valid codecs are {_valid_names()}")


def codec_value(name: str) -> int:
    """The wire enum value of the codec called ``name``.

    Raises:
        CompressionError: no codec has this name.
    """
    if not isinstance(name, str):
        raise CompressionError(f"a codec name must be a string, got {name!r}; valid codecs are {_valid_names()}")
    return get_compressor(name).codec


def check_registry() -> None:
    """Fail unless every wire enum value other than ``CODEC_UNSPECIFIED`` has a codec.

    Raises:
        ImportError: some ``Codec`` values have no registered compressor.
    """
    missing = [
        f"{name} ({value})"
        for name, value in tensor_pb2.Codec.items()
        if value != tensor_pb2.CODEC_UNSPECIFIED and value not in REGISTRY
    ]
    if missing:
        raise ImportError(
            f"the wire enum Codec has values with no compressor: {', '.join(missing)}; implement them in compress/ "
            "with @register, or remove them from proto/fusion/wire/tensor.proto"
        )


# ----------------------------------------------------------------- shared by the codecs


def as_byte_view(data: bytes | memoryview) -> memoryview:
    """``data`` as a flat view of bytes, without copying.

    Raises:
        CompressionError: ``data`` is not a contiguous bytes-like object.
    """
    try:
        view = memoryview(data)
        return view if view.ndim == 1 and view.format in ("B", "b", "c") else view.cast("B")
    except (TypeError, ValueError) as e:
        raise CompressionError(f"encoded tensor data must be contiguous bytes, got {type(data).__name__}: {e}") from e


def check_target(dtype: torch.dtype, shape: tuple[int, ...], *, codec: str) -> int:
    """Validate the ``dtype`` and ``shape`` a decoder was asked for; returns ``numel``.

    Raises:
        CompressionError: ``dtype`` is not a torch dtype or ``shape`` is not a sequence of
            non-negative ints.
    """
    if not isinstance(dtype, torch.dtype):
        raise CompressionError(f"{codec}: decode needs a torch.dtype, got {dtype!r}")
    try:
        dims = tuple(shape)
    except TypeError as e:
        raise CompressionError(f"{codec}: decode needs a shape (a tuple of ints), got {shape!r}") from e
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in dims):
        raise CompressionError(f"{codec}: shape {shape!r} must be non-negative ints below 2**63")
    numel = math.prod(dims)
    if numel >= 2**63:
        raise CompressionError(f"{codec}: shape {shape!r} has more elements than a tensor can hold")
    return numel


def flat_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, row-major, native byte order, any dtype (bool, bfloat16 ...)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (numel,)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(raw: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new, writable CPU tensor from exactly ``numel * itemsize`` raw bytes (checked by the caller)."""
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: one copy, so the tensor owns writable memory (torch.frombuffer shares it).
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (numel * itemsize,)
    return flat.view(dtype).reshape(shape)


def zstd_compress(raw: bytes) -> bytes:
    """zstd at :data:`ZSTD_LEVEL`, with the content size in the frame header."""
    # A compressor object per call: they are not thread-safe, and making one costs microseconds.
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)


def zstd_decompress(data: bytes | memoryview, *, max_size_bytes: int, codec: str) -> bytes:
    """Decompress one zstd frame into at most ``max_size_bytes`` (no decompression bombs).

    zstandard's ``max_output_size`` only applies to frames that do not declare their size (and
    for those it allocates that much up front), so a frame must declare its size and the
    declared size is checked first; trailing data after the frame is rejected.

    Raises:
        CompressionError: not a single valid zstd frame, or it declares or yields more than
            ``max_size_bytes``.
    """
    view = as_byte_view(data)
    try:
        declared = zstandard.frame_content_size(view)
    except zstandard.ZstdError as e:
        raise CompressionError(f"{codec}: payload is not a zstd frame ({e}); was it sent with another codec?") from e
    if declared < 0:
        # zstandard would allocate max_output_size up front for such a frame; compress/'s
        # encoders always write the size, so a frame without it did not come from one.
        raise CompressionError(
            f"{codec}: zstd frame does not declare its decompressed size; fusion's encoders always do"
        )
    if declared > max_size_bytes:
        raise CompressionError(
            f"{codec}: zstd frame declares {declared} bytes, more than the {max_size_bytes} a tensor of this "
            "dtype and shape can need"
        )
    try:
        # max_output_size=0 would mean "unlimited"; 1 still bounds an empty tensor's frame.
        out = zstandard.ZstdDecompressor().decompress(
            view, max_output_size=max(max_size_bytes, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise CompressionError(f"{codec}: corrupt zstd payload ({e})") from e
    if len(out) > max_size_bytes:
        raise CompressionError(f"{codec}: zstd payload holds {len(out)} bytes, more than the {max_size_bytes} expected")
    return out
