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
#: A tensor whose root-mean-square value is at most this is never rejected for its norm:
#: gradients that were near zero (a path the loss barely used yet) legitimately grow by
#: orders of magnitude, while a poisoned update is large in absolute terms.
RMS_FLOOR = 1.0

_KINDS = {pb.TRANSFER_KIND_ACTIVATION: "activation", pb.TRANSFER_KIND_GRADIENT: "gradient"}


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
        self._stats: dict[tuple[int, int, str], _LinkStats] = {}
        self._lock = threading.Lock()
        self.num_rejected = 0

    def check(self, kind: int, src_stage_idx: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`PoisonedInputError` unless every tensor is finite and of a plausible norm.

        The statistics are updated only when the whole transfer is accepted.
        """
        what = _KINDS.get(kind, f"kind-{kind}")
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
                stats = self._stats.get((kind, src_stage_idx, name))
                if stats is None or stats.count < self.warmup:
                    continue
                log_norm = math.log(max(norm, NORM_FLOOR))
                if log_norm - stats.mean_log_norm > self.max_log_ratio and norm > floors[name]:
                    typical = math.exp(stats.mean_log_norm)
                    self.num_rejected += 1
                    raise PoisonedInputError(
                        src_stage_idx,
                        f"{what} {name!r} has norm {norm:.3g}, over {math.exp(self.max_log_ratio):.0f}x "
                        f"the link's running norm {typical:.3g}",
                    )
            for name, norm in norms.items():
                stats = self._stats.setdefault((kind, src_stage_idx, name), _LinkStats())
                log_norm = math.log(max(norm, NORM_FLOOR))
                stats.mean_log_norm = (
                    log_norm if stats.count == 0 else (1 - EMA_WEIGHT) * stats.mean_log_norm + EMA_WEIGHT * log_norm
                )
                stats.count += 1

    def _reject(self, src_stage_idx: int, reason: str) -> None:
        with self._lock:
            self.num_rejected += 1
        raise PoisonedInputError(src_stage_idx, reason)
