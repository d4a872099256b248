"""Compression on a stage's cuts: which codec each cut uses, in which direction, with what ratio.

The plan marks cuts (producer stage → consumer stage) with a codec and a keep ratio; the
codecs themselves live in :mod:`compress`. On a compressed cut:

- **Forward activations** are sparsified by the sender (top-k keeps the largest
  magnitudes); the receiver computes with the sparse tensor. The sender keeps the mask of
  kept positions per (consumer, micro-batch, value), and when that consumer's gradient
  comes back it passes gradient only where values were kept — the exact gradient of the
  sparsified forward.
  ``topk-quant`` keeps a mask the same way. A quantized activation (``quant``) keeps every
  position, so backward passes the full gradient (straight-through).
- **Backward gradients** are compressed by the consumer before it sends them upstream, with
  error feedback: what the codec lost (top-k's dropped entries, quantization's rounding)
  is kept per (cut, value, micro-batch slot) and added to the next gradient for that slot,
  so over steps nothing is lost for good.

Integer tensors and non-tensor values always travel dense. Lossy dense codecs (``fp16``)
pass gradients straight through. The residuals are stage state (``state_dict``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from compress import REGISTRY, AdaTopK, ErrorFeedback, get_compressor
from executor.guard import CodecSetting
from executor.transport import dtype_to_wire
from fusion.errors import CompressionError
from fusion.wire import executor_pb2 as epb
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: Wire codec enum → codec name, for the plan's codec names.
CODEC_NAMES = {c.codec: c.name for c in REGISTRY.values()}
CODEC_VALUES = {v: k for k, v in CODEC_NAMES.items()}
#: Codecs that keep a top-k mask: backward through their activations is masked.
SPARSE_CODECS = (pb.CODEC_TOPK, pb.CODEC_TOPK_QUANT)


@dataclass
class CutSetting:
    """How one cut is encoded."""

    codec: int
    """A ``fusion.wire.tensor_pb2.Codec`` value."""
    keep_ratio: float = 1.0
    activations: bool = True
    gradients: bool = True
    bits: int = 8
    """Bits per value of ``quant`` and ``topk-quant`` (4 or 8)."""
    gradient_codec: int | None = None
    """The gradients' codec when it differs from the activations'; None: the same setting."""
    gradient_keep_ratio: float = 1.0
    gradient_bits: int = 8

    @property
    def active(self) -> bool:
        """Whether tensors on the cut are encoded now (top-k at ratio 1 sends them dense)."""
        if self.codec == pb.CODEC_TOPK and self.keep_ratio >= 1.0:  # topk-quant still quantizes
            return False
        return self.codec not in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED)

    def for_gradients(self) -> CutSetting:
        """The setting the gradients use (this one unless the gradients have their own)."""
        if self.gradient_codec is None:
            return self
        return CutSetting(
            codec=self.gradient_codec,
            keep_ratio=self.gradient_keep_ratio,
            activations=self.activations,
            gradients=self.gradients,
            bits=self.gradient_bits,
        )

    def describe(self) -> dict[str, Any]:
        """``{"codec", "keep_ratio", "bits"}`` for metrics (bits 0 when not quantized)."""
        name = CODEC_NAMES.get(self.codec, str(self.codec))
        quantized = self.codec in (pb.CODEC_QUANT, pb.CODEC_TOPK_QUANT)
        return {"codec": name, "keep_ratio": round(self.keep_ratio, 5), "bits": self.bits if quantized else 0}


def setting_to_wire(cut: tuple[int, int], c: CutSetting) -> epb.CutCodec:
    """The wire form of a cut's setting."""
    return epb.CutCodec(
        src_stage_idx=cut[0],
        dst_stage_idx=cut[1],
        codec=c.codec,
        keep_ratio=c.keep_ratio,
        activations=c.activations,
        gradients=c.gradients,
        bits=c.bits,
        gradient_codec=pb.CODEC_UNSPECIFIED if c.gradient_codec is None else c.gradient_codec,
        gradient_keep_ratio=c.gradient_keep_ratio if c.gradient_codec is not None else 0.0,
        gradient_bits=c.gradient_bits if c.gradient_codec is not None else 0,
    )


def setting_from_wire(c: epb.CutCodec) -> CutSetting:
    """A cut's setting from the wire (unset fields take their documented defaults)."""
    own = c.gradient_codec != pb.CODEC_UNSPECIFIED
    return CutSetting(
        codec=c.codec,
        keep_ratio=c.keep_ratio or 1.0,
        activations=c.activations,
        gradients=c.gradients,
        bits=c.bits or 8,
        gradient_codec=c.gradient_codec if own else None,
        gradient_keep_ratio=(c.gradient_keep_ratio or 1.0) if own else 1.0,
        gradient_bits=(c.gradient_bits or 8) if own else 8,
    )


def dense_settings(settings: Mapping[tuple[int, int], CutSetting]) -> dict[tuple[int, int], CutSetting]:
    """``settings`` with every cut sent dense both ways (ratios and bits kept, so that the
    next compressed step finds them unchanged)."""
    return {
        cut: replace(s, codec=pb.CODEC_NONE, gradient_codec=None if s.gradient_codec is None else pb.CODEC_NONE)
        for cut, s in settings.items()
    }


def link_codecs(settings: Mapping[tuple[int, int], CutSetting]) -> dict[tuple[int, int], dict[str, Any]]:
    """Per directed link ``(sender, receiver)`` that encodes, its codec, keep ratio and bits:
    a cut ``(a, b)`` sends activations on ``(a, b)`` and gradients on ``(b, a)``."""
    out = {}
    for (a, b), setting in settings.items():
        if setting.activations and setting.active:
            out[(a, b)] = setting.describe()
        grads = setting.for_gradients()
        if setting.gradients and grads.active:
            out[(b, a)] = grads.describe()
    return out


Encoded = dict[str, tuple[pb.TensorMeta, bytes]]


class CutCompression:
    """One stage's view of the compressed cuts it sends or receives on."""

    def __init__(self, stage_idx: int, settings: Mapping[tuple[int, int], CutSetting]) -> None:
        self.stage_idx = stage_idx
        self.settings = dict(settings)
        self.feedback = ErrorFeedback()
        self._masks: dict[tuple[int, int, str], torch.Tensor] = {}
        #: Per peer stage this step: [sum ||x - x_hat||^2, sum ||x||^2] of what was encoded.
        self._errors: dict[int, list[float]] = {}
        self._lock = threading.Lock()

    def set_step(self, settings: Mapping[tuple[int, int], CutSetting]) -> None:
        """This step's settings of known cuts: AdaTopK's new keep ratios, or every cut dense
        for a step of the codec trial (:mod:`executor.codec_trial`). Cuts the stage was not
        loaded with are ignored; a cut sent dense hands over its error-feedback residual
        (:meth:`encode_gradients`).

        Raises:
            CompressionError: a keep ratio outside (0, 1] or an unknown codec (nothing changed).
        """
        known = {cut: s for cut, s in settings.items() if cut in self.settings}
        for cut, setting in known.items():
            for ratio in (setting.keep_ratio, setting.gradient_keep_ratio):
                if not 0.0 < ratio <= 1.0:
                    raise CompressionError(f"keep ratio {ratio} for cut {cut} is outside (0, 1]")
            get_compressor(setting.codec)
            if setting.gradient_codec is not None:
                get_compressor(setting.gradient_codec)
        self.settings.update((cut, replace(s)) for cut, s in known.items())

    def reset_step(self) -> None:
        """Forget masks and errors of the previous step (residuals carry over)."""
        self._masks.clear()
        with self._lock:
            self._errors.clear()

    def relative_errors(self) -> dict[int, float]:
        """Per peer stage, ``||x - x_hat|| / ||x||`` over everything encoded to it this step."""
        with self._lock:
            return {peer: (err / norm) ** 0.5 if norm > 0 else 0.0 for peer, (err, norm) in self._errors.items()}

    def _encode(
        self, setting: CutSetting, name: str, t: torch.Tensor, peer: int
    ) -> tuple[pb.TensorMeta, bytes, torch.Tensor | None, torch.Tensor]:
        """Encode one tensor for stage ``peer``; returns its header entry, bytes, mask and the
        decoded value (what the receiver will compute with), and adds to ``peer``'s error."""
        codec = get_compressor(setting.codec)
        enc = codec.encode(t.detach(), keep_ratio=min(1.0, setting.keep_ratio), bits=setting.bits)
        meta = pb.TensorMeta(
            name=name, dtype=dtype_to_wire(t.dtype), shape=list(t.shape), size_bytes=len(enc.data), codec=setting.codec
        )
        sent = codec.decode(enc.data, dtype=t.dtype, shape=tuple(t.shape)).to(t.device)
        x = t.detach().float()
        err = float(torch.linalg.vector_norm(x - sent.float()) ** 2)
        norm = float(torch.linalg.vector_norm(x) ** 2)
        with self._lock:
            acc = self._errors.setdefault(peer, [0.0, 0.0])
            acc[0] += err
            acc[1] += norm
        return meta, enc.data, enc.mask, sent

    def encode_activations(
        self, dst: int, m: int, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], Encoded, int]:
        """Split outgoing activations into (dense tensors, encoded tensors, dense bytes)."""
        dense_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        setting = self.settings.get((self.stage_idx, dst))
        if setting is None or not setting.active or not setting.activations:
            return dict(tensors), {}, dense_bytes
        raw: dict[str, torch.Tensor] = {}
        encoded: Encoded = {}
        for name, t in tensors.items():
            if not t.is_floating_point() or t.numel() == 0 or (setting.codec in SPARSE_CODECS and t.numel() < 2):
                raw[name] = t
                continue
            meta, data, mask, _ = self._encode(setting, name, t, dst)
            encoded[name] = (meta, data)
            if mask is not None:
                self._masks[(dst, m, name)] = mask.view(t.shape)
        return raw, encoded, dense_bytes

    def mask_gradient(self, dst: int, m: int, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Gradient of a sparsified activation: only where the value was kept."""
        mask = self._masks.pop((dst, m, name), None)
        return grad if mask is None else grad * mask.to(grad.device, grad.dtype)

    def guard_settings(self, kind: int, src: int, metas: Iterable[pb.TensorMeta]) -> dict[str, CodecSetting]:
        """What the guard needs to know of each received tensor's codec (:mod:`executor.guard`).

        ``src`` sent the tensors; activations arrive on cut ``(src, self)``, gradients on
        ``(self, src)``.
        """
        cut = (src, self.stage_idx) if kind == pb.TRANSFER_KIND_ACTIVATION else (self.stage_idx, src)
        setting = self.settings.get(cut)
        if setting is not None and kind == pb.TRANSFER_KIND_GRADIENT:
            setting = setting.for_gradients()
        out = {}
        for meta in metas:
            if meta.codec in (pb.CODEC_NONE, pb.CODEC_UNSPECIFIED) or meta.codec not in CODEC_NAMES:
                continue
            out[meta.name] = CodecSetting(
                codec=CODEC_NAMES[meta.codec],
                bits=setting.bits if setting is not None else 8,
                keep_ratio=setting.keep_ratio if setting is not None else 1.0,
            )
        return out

    def encode_gradients(
        self, src: int, m: int, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], Encoded, int]:
        """Split outgoing gradients (to producer ``src``) into dense and encoded, with error feedback."""
        dense_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        setting = self.settings.get((src, self.stage_idx))
        setting = None if setting is None else setting.for_gradients()
        if setting is None or not setting.active or not setting.gradients:
            # Sending dense: hand over what error feedback still owes, so no residual goes
            # stale and resurfaces steps later if the cut is compressed again.
            out = {}
            for name, g in tensors.items():
                key = (src, self.stage_idx, name, m)
                if self.feedback.residual(key) is not None:
                    out[name] = self.feedback.compensate(key, g.detach())
                    self.feedback.update(key, out[name], out[name])  # nothing left over
                else:
                    out[name] = g
            return out, {}, dense_bytes
        raw: dict[str, torch.Tensor] = {}
        encoded: Encoded = {}
        for name, g in tensors.items():
            if not g.is_floating_point() or g.numel() < 2:
                raw[name] = g
                continue
            key = (src, self.stage_idx, name, m)
            compensated = self.feedback.compensate(key, g.detach())
            meta, data, _, sent = self._encode(setting, name, compensated, src)
            self.feedback.update(key, compensated, sent)
            encoded[name] = (meta, data)
        return raw, encoded, dense_bytes


def decode_tensor(meta: pb.TensorMeta, raw: memoryview) -> torch.Tensor:
    """Decode a received tensor that uses a codec (``CompressionError`` when malformed)."""
    from executor.transport import dtype_from_wire

    codec = get_compressor(meta.codec)
    return codec.decode(raw, dtype=dtype_from_wire(meta.dtype), shape=tuple(meta.shape))


def cut_settings(cuts: Iterable[Sequence[Any]], *, directions: tuple[str, ...]) -> dict[tuple[int, int], CutSetting]:
    """Settings from a plan's cuts ``(src, dst, codec name, keep ratio[, bits[, gradient codec
    name or None, gradient keep ratio, gradient bits]])`` and the job's directions."""
    out = {}
    for src, dst, codec, ratio, *rest in cuts:
        bits = int(rest[0]) if rest and rest[0] else 8
        grad = rest[1:4] if len(rest) > 1 and rest[1] is not None else None
        if codec == "none" and (grad is None or grad[0] == "none"):
            continue
        for name in (codec, grad[0] if grad else codec):
            if name not in CODEC_VALUES:
                raise CompressionError(
                    f"cut {src}->{dst} names unknown codec {name!r}; use one of {sorted(CODEC_VALUES)}"
                )
        out[(src, dst)] = CutSetting(
            codec=CODEC_VALUES[codec],
            keep_ratio=ratio,
            activations="activations" in directions,
            gradients="gradients" in directions,
            bits=bits,
            gradient_codec=None if grad is None else CODEC_VALUES[grad[0]],
            gradient_keep_ratio=1.0 if grad is None else float(grad[1] or 1.0),
            gradient_bits=8 if grad is None else int(grad[2] or 8),
        )
    return out


def encodes_any(settings: Mapping[tuple[int, int], CutSetting]) -> bool:
    """Whether any cut encodes a tensor in a direction it applies to. AdaTopK's choice of
    ratio 1 on every cut sends everything dense, and the driver's controller never lowers a
    cut below its planned ratio (:class:`RatioController`'s floors), so such a placement
    encodes nothing."""
    return any((s.activations and s.active) or (s.gradients and s.for_gradients().active) for s in settings.values())


LinkEstimate = Callable[[int, int], "tuple[float, float] | None"]


class RatioController:
    """AdaTopK in the driver: after every step, a new keep ratio per compressed cut.

    The target is the pipeline's bottleneck compute per micro-batch (the slowest stage's
    compute seconds divided by the micro-batches): a cut whose transfer takes about that
    long no longer slows the pipeline, and keeping more would only add error. The link's
    latency and bandwidth come from ``link_of`` (the coordinator's measured, refreshed
    link table), else from the step's own transfers.
    """

    def __init__(
        self,
        controller: AdaTopK,
        *,
        link_of: LinkEstimate | None = None,
        floors: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        self.controller = controller
        self.link_of = link_of
        #: Per cut, the lowest ratio to return: the plan's choice for time to loss, which a
        #: link measured faster may raise but a slower one may not lower (fewer entries
        #: would cost more steps than the step time they save, :mod:`scheduler.compression`).
        self.floors = dict(floors or {})

    def update(self, stats: Any, micro_batches: int) -> dict[tuple[int, int], float]:
        if not stats.compute_s:
            return {}
        target = max(stats.compute_s.values()) / micro_batches
        ratios = {}
        for cut in stats.keep_ratios:
            dense = stats.dense_bytes.get(cut, 0) / micro_batches
            if dense <= 0:
                continue
            link = self.link_of(*cut) if self.link_of is not None else None
            if link is None:
                seconds = stats.sent_s.get(cut, 0.0) / micro_batches
                sent = stats.sent_bytes.get(cut, 0) / micro_batches
                if seconds <= 0 or sent <= 0:
                    continue
                link = (0.0, sent / seconds)
            _, bandwidth = link
            # Sends are asynchronous and overlap: a link's latency delays the first
            # micro-batch once per step but does not limit the rate, which the bytes do.
            ratio = self.controller.ratio(
                cut,
                numel=int(dense // 4),
                dense_bytes=int(dense),
                bandwidth_bytes_per_s=bandwidth,
                latency_s=0.0,
                target_s=target,
            )
            ratios[cut] = max(ratio, self.floors.get(cut, 0.0))
        return ratios
