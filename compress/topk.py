"""Top-k sparsification: keep the ``k`` entries of largest magnitude, drop the rest.

Wire format (one zstd level-1 frame; little-endian)::

    header   24 bytes  struct "<4sBBxxQQ": magic b"FzTK", format version, index kind, k, numel
    indices            BITMAP: numpy.packbits of the kept mask, ceil(numel / 8) bytes,
                       most significant bit first, padding bits zero;
                       DELTA_U8/U16/U32: k gaps between sorted indices (the first gap is the
                       first index), each in the narrowest width that holds the largest gap
    values   2k bytes  the kept entries in float16, in index order

The encoder sends whichever index section is smaller for this tensor: a bitmap costs
``numel / 8`` bytes whatever ``k`` is, deltas ``k * width``, so deltas win below a density
of roughly 1/8 (uint8 gaps, i.e. dense clusters), 1/16 (uint16) or 1/32 (uint32). zstd then
removes what is left of the redundancy (small gaps, repeated exponents).

``k = max(1, ceil(keep_ratio * numel))`` (:func:`num_kept`); on a tie in magnitude any of the
tied entries may be kept. The decoder validates every field before it allocates the output,
so a malformed payload costs no more than the tensor the caller expects.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import struct

import numpy as np
import torch

from compress.base import Compressor, Encoded, check_target, register, zstd_compress, zstd_decompress
from compress.dense import to_half_saturating
from fusion.errors import CompressionError
from fusion.wire import tensor_pb2

logger = logging.getLogger(__name__)

MAGIC = b"FzTK"
FORMAT_VERSION = 1
#: magic, format version, index kind, 2 pad bytes, k, numel.
HEADER = struct.Struct("<4sBBxxQQ")
#: Bytes per kept value (float16).
VALUE_BYTES = 2


class IndexKind(enum.IntEnum):
    """How the kept positions are stored (the header's index kind byte)."""

    BITMAP = 1
    DELTA_U8 = 2
    DELTA_U16 = 3
    DELTA_U32 = 4


#: Delta kinds, narrowest first, with their little-endian numpy dtype.
_DELTA_DTYPES: dict[IndexKind, np.dtype] = {
    IndexKind.DELTA_U8: np.dtype("<u1"),
    IndexKind.DELTA_U16: np.dtype("<u2"),
    IndexKind.DELTA_U32: np.dtype("<u4"),
}


def num_kept(numel: int, keep_ratio: float) -> int:
    """``k = max(1, ceil(keep_ratio * numel))`` (0 for an empty tensor).

    The product is rounded down by 1e-6 before ``ceil`` so that a ratio computed as
    ``k / numel`` gives back ``k``, not ``k + 1`` from float rounding.

    Raises:
        ValueError: ``keep_ratio`` is not in ``(0, 1]``.
    """
    if isinstance(keep_ratio, bool) or not (isinstance(keep_ratio, numbers.Real) and 0.0 < keep_ratio <= 1.0):
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(keep_ratio * numel - 1e-6)))


def _delta_kind(max_delta: int) -> IndexKind | None:
    """The narrowest delta kind that holds ``max_delta``, or None if none does."""
    for kind, dtype in _DELTA_DTYPES.items():
        if max_delta <= np.iinfo(dtype).max:
            return kind
    return None


def _bitmap_bytes(numel: int) -> int:
    return (numel + 7) // 8


def topk_encoded_size(numel: int, k: int) -> int:
    """Upper estimate of the payload :class:`TopKCompressor` builds for ``k`` of ``numel``
    entries, before zstd: header + min(bitmap, deltas) + 2k bytes.

    The delta width is taken for the largest gap any index in ``[0, numel)`` can have,
    ``numel - 1``, so the real payload is never larger, and the estimate never decreases as
    ``k`` grows (the controller bisects on it). Real gaps are usually much smaller (about
    ``numel / k``), and zstd shrinks the payload further (on incompressible data it adds a
    few bytes per 128 KiB block instead). Pure arithmetic.

    Raises:
        ValueError: not ``0 <= k <= numel``.
    """
    if not 0 <= k <= numel:
        raise ValueError(f"need 0 <= k <= numel, got k={k}, numel={numel}")
    index_bytes = _bitmap_bytes(numel)
    if k > 0:
        kind = _delta_kind(numel - 1)
        if kind is not None:
            index_bytes = min(index_bytes, k * _DELTA_DTYPES[kind].itemsize)
    return HEADER.size + index_bytes + VALUE_BYTES * k


#: Up to this many elements (or off the CPU) :func:`select_topk` calls ``torch.topk``
#: directly; above it, on the CPU, it narrows the candidates first. Measured on 2 cores:
#: ``torch.topk`` on 16M floats takes ~0.55 s, the narrowed selection ~0.07 s; at 64K
#: elements both take ~0.5 ms.
EXACT_SELECT_NUMEL = 1 << 16
#: Elements sampled to bracket the k-th largest magnitude (the band between the thresholds
#: holds about ``8 * sqrt(p (1 - p) / SAMPLE_NUMEL)`` of the tensor, p = k / numel: <= 3%).
SAMPLE_NUMEL = 1 << 14
#: Half-width of the bracket, in binomial standard deviations of the sample count.
BRACKET_SIGMAS = 4.0


def select_topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the ``k`` largest ``|flat|`` (NaN counts as largest, ties any).

    Returns the positions ascending, ``(k,)`` int64, and the same as a bool mask ``(numel,)``,
    both on ``flat``'s device. Exactly what ``torch.topk(flat.abs(), k)`` selects up to ties.

    Large CPU tensors avoid a full ``torch.topk``: the magnitudes of a fixed-seed random
    sample give thresholds ``lo <= hi`` that bracket the k-th largest magnitude with high
    probability (``BRACKET_SIGMAS`` binomial deviations each side). Everything above ``hi`` is
    kept, everything below ``lo`` dropped, and ``torch.topk`` picks the rest from the narrow
    band between. If the bracket misses (a count outside ``[k - band, k]``) it falls back to
    ``torch.topk`` on everything, so the result is exact either way.
    """
    numel = flat.numel()
    device = flat.device
    if k == numel:
        return torch.arange(numel, device=device), torch.ones(numel, dtype=torch.bool, device=device)
    mag = flat.abs().nan_to_num_(nan=math.inf)  # (numel,)
    mask = None
    if device.type == "cpu" and numel > EXACT_SELECT_NUMEL:
        mask = _bracketed_mask(mag, k)
    if mask is None:
        idx = torch.topk(mag, k, sorted=False).indices  # (k,) unordered
        mask = torch.zeros(numel, dtype=torch.bool, device=device)
        mask[idx] = True
        if device.type != "cpu":
            return idx.sort().values, mask
    # Reading the mask back is ~5x faster than sorting the indices (numpy's is faster than torch's).
    return torch.from_numpy(np.flatnonzero(mask.numpy())), mask


def _bracketed_mask(mag: torch.Tensor, k: int) -> torch.Tensor | None:
    """The top-k mask of ``mag`` via a sampled bracket, or None if the bracket missed."""
    numel = mag.numel()
    generator = torch.Generator().manual_seed(numel)  # deterministic: same input, same output
    # float64 holds every float dtype's values exactly (and numpy has no bfloat16); numpy
    # sorts 10x faster than torch on the CPU.
    sample = np.sort(mag[torch.randint(numel, (SAMPLE_NUMEL,), generator=generator)].double().numpy())  # (S,)
    frac = k / numel
    rank = (1.0 - frac) * SAMPLE_NUMEL  # sample position of the k-th largest
    spread = BRACKET_SIGMAS * math.sqrt(SAMPLE_NUMEL * frac * (1.0 - frac)) + 2.0
    lo_pos, hi_pos = math.floor(rank - spread), math.ceil(rank + spread)
    # Past either end of the sample the bracket is open on that side (the sample's extremes
    # are not the tensor's).
    above = mag > float(sample[hi_pos]) if hi_pos < SAMPLE_NUMEL else torch.zeros_like(mag, dtype=torch.bool)
    num_above = int(np.count_nonzero(above.numpy()))  # bool .sum() in torch is ~20x slower
    band = ~above
    if lo_pos > 0:
        band &= mag >= float(sample[lo_pos])
    band_idx = torch.from_numpy(np.flatnonzero(band.numpy()))  # (B,) candidates for the last k - num_above places
    needed = k - num_above
    if not 0 <= needed <= band_idx.numel():
        logger.debug("top-k bracket missed (k=%d, above=%d, band=%d); full torch.topk", k, num_above, band_idx.numel())
        return None
    if needed:
        above[band_idx[torch.topk(mag[band_idx], needed, sorted=False).indices]] = True
    return above


def encode_indices(idx: torch.Tensor, mask: torch.Tensor) -> tuple[IndexKind, bytes]:
    """The smaller index section for ascending positions ``idx`` ``(k,)`` and their flat
    bool ``mask`` ``(numel,)``: deltas in the narrowest width that holds the largest gap, or
    a bitmap when that is no larger."""
    numel, k = mask.numel(), idx.numel()
    if k > 0:
        deltas = np.diff(idx.cpu().numpy(), prepend=0)  # (k,) int64; first = first index
        delta_kind = _delta_kind(int(deltas.max()))
        if delta_kind is not None and k * _DELTA_DTYPES[delta_kind].itemsize < _bitmap_bytes(numel):
            return delta_kind, deltas.astype(_DELTA_DTYPES[delta_kind]).tobytes()
    return IndexKind.BITMAP, np.packbits(mask.cpu().numpy()).tobytes()


def index_section_bytes(kind: IndexKind, k: int, numel: int, *, codec: str) -> int:
    """Bytes of an index section of ``kind`` for ``k`` of ``numel`` positions.

    Raises:
        CompressionError: deltas would be larger than a bitmap (no encoder sends that).
    """
    bitmap_bytes = _bitmap_bytes(numel)
    if kind is IndexKind.BITMAP:
        return bitmap_bytes
    index_bytes = k * _DELTA_DTYPES[kind].itemsize
    if index_bytes > bitmap_bytes:
        raise CompressionError(
            f"{codec}: {kind.name} indices take {index_bytes} bytes, more than a {bitmap_bytes}-byte bitmap; "
            "this encoder never sends that"
        )
    return index_bytes


def decode_indices(raw: bytes, offset: int, kind: IndexKind, k: int, numel: int, *, codec: str) -> np.ndarray:
    """The ``k`` ascending positions, ``(k,)`` int64, of the index section at ``offset``
    (whose length the caller has checked).

    Raises:
        CompressionError: padding bits set, a count that is not ``k``, a repeated position
            or one past ``numel - 1``.
    """
    if kind is IndexKind.BITMAP:
        bitmap_bytes = _bitmap_bytes(numel)
        bits = np.unpackbits(np.frombuffer(raw, np.uint8, count=bitmap_bytes, offset=offset)).view(np.bool_)
        if bits[numel:].any():  # bits: (8 * bitmap_bytes,), as bool for numpy's fast nonzero
            raise CompressionError(f"{codec}: bitmap has padding bits set past the last element")
        idx = np.flatnonzero(bits[:numel])  # (popcount,) ascending
        if idx.size != k:
            raise CompressionError(f"{codec}: bitmap keeps {idx.size} positions, the header says k = {k}")
        return idx
    deltas = np.frombuffer(raw, _DELTA_DTYPES[kind], count=k, offset=offset)  # (k,)
    if k > 1 and not deltas[1:].all():
        raise CompressionError(f"{codec}: delta indices repeat a position (a zero gap after the first)")
    idx = np.cumsum(deltas, dtype=np.int64)  # (k,) strictly ascending
    if k > 0 and idx[-1] >= numel:
        raise CompressionError(
            f"{codec}: delta indices reach position {int(idx[-1])}, past the last element {numel - 1}"
        )
    return idx


@register
class TopKCompressor(Compressor):
    """Keep the ``k`` largest-magnitude entries of a float tensor, in float16."""

    codec = tensor_pb2.CODEC_TOPK
    name = "topk"
    lossless = False

    def encode(
        self, tensor: torch.Tensor, *, keep_ratio: float = 1.0, bits: int = 8, seed: int | None = None
    ) -> Encoded:
        """Sparsify ``tensor`` to ``num_kept(numel, keep_ratio)`` entries.

        ``Encoded.mask`` is the kept positions, a flat bool ``(numel,)`` on ``tensor``'s device.

        Raises:
            CompressionError: ``tensor`` is not floating point.
            ValueError: ``keep_ratio`` is not in ``(0, 1]``.
        """
        if not tensor.is_floating_point():
            raise CompressionError(
                f"topk encodes floating-point tensors only, got {tensor.dtype}; use 'none' or 'zstd'"
            )
        numel = tensor.numel()
        k = num_kept(numel, keep_ratio)
        flat = tensor.detach().reshape(-1)  # (numel,)
        idx, mask = select_topk(flat, k)
        values = to_half_saturating(flat[idx]).cpu().numpy().astype("<f2", copy=False)  # (k,)

        kind, index_section = encode_indices(idx, mask)
        payload = b"".join((HEADER.pack(MAGIC, FORMAT_VERSION, kind, k, numel), index_section, values.tobytes()))
        return Encoded(self.codec, zstd_compress(payload), numel * tensor.element_size(), mask)

    def decode(self, data: bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A dense CPU tensor of ``dtype`` and ``shape``: the kept values, zeros elsewhere."""
        numel = check_target(dtype, shape, codec=self.name)
        if not dtype.is_floating_point:
            raise CompressionError(f"topk: cannot decode into {dtype}; topk carries floating-point tensors only")
        bitmap_bytes = _bitmap_bytes(numel)
        # Largest canonical payload for any k: a bitmap (deltas are sent only when smaller) and
        # numel values, i.e. about 2.1 bytes per element, less than the tensor decoding allocates.
        raw = zstd_decompress(data, max_size_bytes=HEADER.size + bitmap_bytes + VALUE_BYTES * numel, codec=self.name)
        if len(raw) < HEADER.size:
            raise CompressionError(f"topk: payload of {len(raw)} bytes is shorter than the {HEADER.size}-byte header")
        magic, version, kind_value, k, sent_numel = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise CompressionError(f"topk: bad magic {magic!r} (expected {MAGIC!r}); the payload is not top-k encoded")
        if version != FORMAT_VERSION:
            raise CompressionError(
                f"topk: format version {version}, this build reads {FORMAT_VERSION}; upgrade fusion on both ends"
            )
        try:
            kind = IndexKind(kind_value)
        except ValueError:
            raise CompressionError(
                f"topk: unknown index kind {kind_value}; valid are {[int(k) for k in IndexKind]}"
            ) from None
        if sent_numel != numel:
            raise CompressionError(
                f"topk: payload is for {sent_numel} elements, but shape {tuple(shape)} has {numel}; "
                "the sender and receiver disagree on the tensor's shape"
            )
        if k > numel or (k == 0 and numel > 0):
            raise CompressionError(f"topk: k = {k} is not in [1, {numel}]")

        index_bytes = index_section_bytes(kind, k, numel, codec=self.name)
        expected = HEADER.size + index_bytes + VALUE_BYTES * k
        if len(raw) != expected:
            raise CompressionError(
                f"topk: payload has {len(raw)} bytes, {kind.name} indices for k = {k} of {numel} need {expected}"
            )

        offset = HEADER.size
        idx = decode_indices(raw, offset, kind, k, numel, codec=self.name)
        values = np.frombuffer(raw, "<f2", count=k, offset=offset + index_bytes).astype(np.float16)  # (k,) own copy

        out = torch.zeros(numel, dtype=dtype)
        if k > 0:
            out[torch.from_numpy(idx)] = torch.from_numpy(values).to(dtype)
        return out.reshape(tuple(shape))
