"""Poisoned contributions: check every incoming activation and gradient before it is used.

A volunteer can send NaN/Inf (a broken GPU, a bug) or huge finite values (malice) that
would wreck the model after one optimizer step. Each stage therefore checks what it
receives from another stage (the driver's inputs and targets are the job owner's own):

- every floating-point value must be finite;
- the tensor's L2 norm must stay within :data:`MAX_NORM_RATIO` of the running statistics
  of its link — an exponential moving average of ``log(norm)`` per (kind, sending stage,
  value name), updated only with accepted tensors and enforced after
  :data:`WARMUP_OBSERVATIONS` of them. Training legitimately moves norms by a few times
  (loss spikes, learning-rate warm-up); a thousandfold jump in one step is not learning.

Compressed tensors are judged against what their codec can produce (:class:`CodecSetting`).
Statistics are kept per codec setting (codec, bits, keep ratio within a factor of 2) as
well as per link. A codec keeps at least a fraction ``delta`` of a tensor's energy
(top-k: ``|C(x)|^2 >= (k/d) |x|^2``; block quantization at ``q_max``: the rounding error
is at most ``B / (4 q_max^2)`` of a block of ``B`` entries' energy), so:

- a compressed gradient carries error feedback's residual; with ``|x - C(x)| <=
  sqrt(1 - delta) |x|`` the residual stays below ``sqrt(1 - delta) / (1 - sqrt(1 - delta))
  <= 2 / delta`` times the largest gradient (Karimireddy et al., ICML 2019, Lemma 3), so its
  bound is widened by ``2 / delta``;
- until a setting has its own statistics, the link's (any codec) judge it, widened also by
  ``1 / sqrt(delta)`` of every setting the link has seen (how far one codec's norm may sit
  below another's).

The widening is capped at :data:`MAX_ALLOWANCE`, so a millionfold update is always caught.

A rejected tensor raises :class:`~fusion.errors.PoisonedInputError` naming the sender; the
stage fails its step with it, and the driver reports the sender (see
:mod:`executor.driver`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fusion.errors import PoisonedInputError
from fusion.wire import tensor_pb2 as pb

logger = logging.getLogger(__name__)

#: A norm above this multiple of the link's running (geometric) mean is rejected.
MAX_NORM_RATIO = 1000.0
#: Accepted observations of a link before its norm bound is enforced.
WARMUP_OBSERVATIONS = 3
#: Weight of a new observation in the running mean of log-norms.
EMA_WEIGHT = 0.2
#: Norms below this are treated as this (log of zero).
NORM_FLOOR = 1e-30
#: Largest factor a codec's allowances widen the norm bound by (see the module docstring).
MAX_ALLOWANCE = 100.0
#: Lowest energy fraction credited to any codec (keeps the allowances finite).
MIN_RETAINED = 1e-4
#: A tensor whose root-mean-square value is at most this is never rejected for its norm:
#: gradients that were near zero (a path the loss barely used yet) legitimately grow by
#: orders of magnitude, while a poisoned update is large in absolute terms.
RMS_FLOOR = 1.0

_KINDS = {pb.TRANSFER_KIND_ACTIVATION: "activation", pb.TRANSFER_KIND_GRADIENT: "gradient"}


@dataclass(frozen=True)
class CodecSetting:
    """How a received tensor was encoded, as far as its norm is concerned."""

    codec: str = "none"
    """The codec's name (:mod:`compress`)."""
    bits: int = 8
    """Bits per value of quantizing codecs."""
    keep_ratio: float = 1.0
    """Fraction of entries kept by sparsifying codecs."""

    @property
    def key(self) -> tuple[str, int, int]:
        """Settings whose norms are alike share statistics: keep ratios within a factor of 2."""
        quantized = self.codec in ("quant", "topk-quant")
        sparse = self.codec in ("topk", "topk-quant")
        ratio_bucket = round(math.log2(max(self.keep_ratio, MIN_RETAINED))) if sparse else 0
        return (self.codec, self.bits if quantized else 0, ratio_bucket)

    @property
    def retained(self) -> float:
        """Lower bound ``delta`` on the fraction of a tensor's energy the codec keeps."""
        delta = 1.0
        if self.codec in ("topk", "topk-quant"):
            delta *= min(1.0, self.keep_ratio)
        if self.codec in ("quant", "topk-quant"):
            qmax = 2 ** (self.bits - 1) - 1
            delta *= max(0.0, 1.0 - QUANT_BLOCK / (4.0 * qmax * qmax))
        return max(delta, MIN_RETAINED)


#: Entries per quantization block (:data:`compress.quant.BLOCK_SIZE`), for the energy bound.
QUANT_BLOCK = 128

DENSE = CodecSetting()


@dataclass
class _LinkStats:
    """Running statistics of one value's norm on one link."""

    count: int = 0
    mean_log_norm: float = 0.0


class InputGuard:
    """Finite-ness and norm checks for the tensors one stage receives."""

    def __init__(self, *, max_norm_ratio: float = MAX_NORM_RATIO, warmup: int = WARMUP_OBSERVATIONS) -> None:
        if max_norm_ratio <= 1.0 or warmup < 1:
            raise ValueError("max_norm_ratio must exceed 1 and warmup be at least 1")
        self.max_log_ratio = math.log(max_norm_ratio)
        self.warmup = warmup
        #: (kind, src, name) for the link, plus the setting's key for one codec setting.
        self._stats: dict[tuple, _LinkStats] = {}
        #: Smallest energy fraction of any setting seen per (kind, src, name).
        self._min_retained: dict[tuple[int, int, str], float] = {}
        self._lock = threading.Lock()
        self.num_rejected = 0

    def check(
        self,
        kind: int,
        src_stage_idx: int,
        tensors: Mapping[str, torch.Tensor],
        settings: Mapping[str, CodecSetting] | None = None,
    ) -> None:
        """Raise :class:`PoisonedInputError` unless every tensor is finite and of a plausible norm.

        ``settings`` names the codec of each compressed tensor (dense when absent). The
        statistics are updated only when the whole transfer is accepted.
        """
        what = _KINDS.get(kind, f"kind-{kind}")
        settings = settings or {}
        norms: dict[str, float] = {}
        for name, t in tensors.items():
            if not t.is_floating_point() or t.numel() == 0:
                continue
            x = t.detach().float()
            if not bool(torch.isfinite(x).all()):
                bad = int((~torch.isfinite(x)).sum())
                self._reject(src_stage_idx, f"{what} {name!r} has {bad} NaN/Inf value(s) of {x.numel()}")
            norms[name] = float(torch.linalg.vector_norm(x))
        floors = {name: RMS_FLOOR * math.sqrt(t.numel()) for name, t in tensors.items() if name in norms}
        with self._lock:
            for name, norm in norms.items():
                setting = settings.get(name, DENSE)
                bound = self._bound(kind, src_stage_idx, name, setting)
                if bound is None:
                    continue
                mean_log_norm, max_log_ratio = bound
                if math.log(max(norm, NORM_FLOOR)) - mean_log_norm > max_log_ratio and norm > floors[name]:
                    self.num_rejected += 1
                    raise PoisonedInputError(
                        src_stage_idx,
                        f"{what} {name!r} ({setting.codec}) has norm {norm:.3g}, over {math.exp(max_log_ratio):.0f}x "
                        f"the link's running norm {math.exp(mean_log_norm):.3g}",
                    )
            for name, norm in norms.items():
                setting = settings.get(name, DENSE)
                log_norm = math.log(max(norm, NORM_FLOOR))
                for key in ((kind, src_stage_idx, name), (kind, src_stage_idx, name, setting.key)):
                    stats = self._stats.setdefault(key, _LinkStats())
                    stats.mean_log_norm = (
                        log_norm if stats.count == 0 else (1 - EMA_WEIGHT) * stats.mean_log_norm + EMA_WEIGHT * log_norm
                    )
                    stats.count += 1
                link = (kind, src_stage_idx, name)
                self._min_retained[link] = min(self._min_retained.get(link, 1.0), setting.retained)

    def _bound(self, kind: int, src: int, name: str, setting: CodecSetting) -> tuple[float, float] | None:
        """(running mean log-norm, allowed log ratio) for a tensor, or None while warming up."""
        delta = setting.retained
        allowance = 2.0 / delta if kind == pb.TRANSFER_KIND_GRADIENT and delta < 1.0 else 1.0
        own = self._stats.get((kind, src, name, setting.key))
        if own is not None and own.count >= self.warmup:
            return own.mean_log_norm, self.max_log_ratio + math.log(min(allowance, MAX_ALLOWANCE))
        link = self._stats.get((kind, src, name))
        if link is None or link.count < self.warmup:
            return None
        spread = 1.0 / math.sqrt(min(delta, self._min_retained.get((kind, src, name), 1.0)))
        return link.mean_log_norm, self.max_log_ratio + math.log(min(allowance * spread, MAX_ALLOWANCE))

    def _reject(self, src_stage_idx: int, reason: str) -> None:
        with self._lock:
            self.num_rejected += 1
        raise PoisonedInputError(src_stage_idx, reason)
