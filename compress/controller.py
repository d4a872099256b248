"""AdaTopK: the keep ratio of each compressed link, from its measured bandwidth.

Derivation. With ``M`` micro-batches, per-micro-batch stage times ``c_i`` and link times
``t_j``, a pipeline step takes (DESIGN.md, the scheduler's model)::

    T ~= sum_i c_i + sum_j t_j + (M - 1) * max(max_i c_i, max_j t_j)

A link whose ``t_j`` is at most the bottleneck compute time ``c* = max_i c_i`` costs only
its own ``t_j`` once per step; above ``c*`` it becomes the bottleneck and costs ``t_j`` on
every one of the ``M - 1`` later micro-batches. Sending fewer entries than needed to get
under ``c*`` buys little time and loses accuracy, so the rule is: keep the largest ratio
``r`` whose transfer fits,

    t(r) = latency_s + S(r) / bandwidth_bytes_per_s <= target_s = c*
    <=>  S(r) <= budget = (target_s - latency_s) * bandwidth_bytes_per_s

where ``S(r)`` is :func:`~compress.topk.topk_encoded_size` for ``k = num_kept(numel, r)``,
an upper estimate that never decreases in ``k``, so the largest fitting ``k`` is found by
bisection over ``k`` (``ratio = k / numel``, the encoder's own quantisation), in
``log2(numel)`` steps of arithmetic. Then:

- if the dense tensor already fits (``latency_s + dense_bytes / bandwidth <= target_s``),
  the ratio is 1.0: send it dense (the caller's dense codec), nothing lost;
- otherwise the ratio is clamped to ``[min_keep_ratio, max_keep_ratio]`` (below the
  minimum the link stays the bottleneck rather than destroy the signal) and kept below 1
  (at most ``numel - 1`` entries), so that 1.0 always means dense;
- bandwidth estimates are noisy, so per link the new ratio is mixed with the previous one,
  ``r <- smoothing * r_new + (1 - smoothing) * r_prev`` (an exponential moving average that
  damps oscillation; ``smoothing = 1`` follows the measurement at once);
- a ratio whose estimated size is no smaller than the dense tensor (an fp16 tensor near
  ratio 1) is replaced by 1.0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable

from compress.topk import num_kept, topk_encoded_size

logger = logging.getLogger(__name__)


class AdaTopK:
    """Per-link keep-ratio controller (see the module docstring for the rule).

    Args:
        min_keep_ratio: smallest ratio ever returned for a compressed link, in ``(0, 1]``.
        max_keep_ratio: largest ratio returned while the dense tensor does not fit, in
            ``[min_keep_ratio, 1]``.
        smoothing: weight of the new value in the per-link moving average, in ``(0, 1]``.
    """

    def __init__(self, *, min_keep_ratio: float, max_keep_ratio: float = 1.0, smoothing: float = 0.5) -> None:
        if not 0.0 < min_keep_ratio <= 1.0:
            raise ValueError(f"min_keep_ratio must be in (0, 1], got {min_keep_ratio!r}")
        if not min_keep_ratio <= max_keep_ratio <= 1.0:
            raise ValueError(f"max_keep_ratio must be in [min_keep_ratio={min_keep_ratio}, 1], got {max_keep_ratio!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.min_keep_ratio = float(min_keep_ratio)
        self.max_keep_ratio = float(max_keep_ratio)
        self.smoothing = float(smoothing)
        self._last: dict[Hashable, float] = {}

    def ratio(
        self,
        link: Hashable,
        *,
        numel: int,
        dense_bytes: int,
        bandwidth_bytes_per_s: float,
        latency_s: float,
        target_s: float,
    ) -> float:
        """The keep ratio for the next tensor on ``link``: 1.0 means send it dense (with the
        link's dense codec); below 1.0, top-k encode it at that ratio.

        Args:
            link: any hashable naming the link (and direction / tensor, if they differ).
            numel: elements of the tensor.
            dense_bytes: its size uncompressed.
            bandwidth_bytes_per_s: measured bandwidth of the link.
            latency_s: measured one-way latency of the link.
            target_s: the transfer time to aim for, the bottleneck compute time per micro-batch.

        Raises:
            ValueError: a size is negative, or a time or the bandwidth is not positive.
        """
        if numel < 0 or dense_bytes < 0:
            raise ValueError(f"numel and dense_bytes must be >= 0, got {numel}, {dense_bytes}")
        if not bandwidth_bytes_per_s > 0.0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
        if not (latency_s >= 0.0 and math.isfinite(latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {latency_s!r}")
        if not (target_s > 0.0 and math.isfinite(target_s)):
            raise ValueError(f"target_s must be finite and > 0, got {target_s!r}")

        if numel == 0 or latency_s + dense_bytes / bandwidth_bytes_per_s <= target_s:
            return self._keep(link, 1.0)
        # A compressed ratio stays below 1.0 (1.0 means dense): at most numel - 1 entries.
        k_min = num_kept(numel, self.min_keep_ratio)
        k_max = min(num_kept(numel, self.max_keep_ratio), numel - 1)
        if k_max < k_min:  # no ratio below 1 is allowed (min_keep_ratio = 1, or numel = 1)
            return self._keep(link, 1.0)
        ratio_max = min(self.max_keep_ratio, k_max / numel)
        k = self._largest_fitting_k(numel, (target_s - latency_s) * bandwidth_bytes_per_s, k_min, k_max)
        solved = self.min_keep_ratio if k == k_min else ratio_max if k == k_max else k / numel

        prev = self._last.get(link)
        new = solved if prev is None else self.smoothing * solved + (1.0 - self.smoothing) * prev
        new = min(ratio_max, max(self.min_keep_ratio, new))
        if topk_encoded_size(numel, num_kept(numel, new)) >= dense_bytes:
            new = 1.0
        return self._keep(link, new)

    @staticmethod
    def _largest_fitting_k(numel: int, budget_bytes: float, lo: int, hi: int) -> int:
        """Largest ``k`` in ``[lo, hi]`` with an estimated size within budget (``lo`` if none
        fits): bisection, the size being nondecreasing in ``k``."""
        if topk_encoded_size(numel, lo) > budget_bytes:
            return lo
        if topk_encoded_size(numel, hi) <= budget_bytes:
            return hi
        while hi - lo > 1:  # invariant: lo fits, hi does not
            mid = (lo + hi) // 2
            if topk_encoded_size(numel, mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid
        return lo

    def _keep(self, link: Hashable, value: float) -> float:
        self._last[link] = value
        return value

    def last(self, link: Hashable) -> float | None:
        """The ratio last returned for ``link``, or None if it was never asked for."""
        return self._last.get(link)

    def reset(self) -> None:
        """Forget every link's history (after a re-plan)."""
        self._last.clear()

    def __repr__(self) -> str:
        return (
            f"AdaTopK(min_keep_ratio={self.min_keep_ratio}, max_keep_ratio={self.max_keep_ratio}, "
            f"smoothing={self.smoothing}, links={len(self._last)})"
        )
