"""The convergence cost of compression: how many more steps a setting needs to reach a loss.

What counts is *time to accuracy*: ``T_loss = step_s × steps``. Compressing a cut shortens
the step and lengthens the run; this module predicts the second factor as a multiplier
``m >= 1`` on the steps dense training needs, from the relative error each setting makes
on the tensors that cross the cut (measured by :mod:`compress.calibration`).

Derivation. A cut's codec ``C`` replaces a tensor ``x`` by ``C(x)`` with relative error
``e = ||x - C(x)|| / ||x||``. Top-k and quantization are *contractions*,
``||x - C(x)||^2 <= (1 - delta) ||x||^2`` with ``delta = 1 - e^2`` (Stich et al., NeurIPS
2018; Karimireddy et al., ICML 2019). A compressed activation perturbs every gradient
computed downstream of it, a compressed gradient perturbs every parameter update upstream;
either way the update becomes ``g + n`` with ``E||n||^2 ~ e^2 ||g||^2``. SGD's steps to a
loss grow with the gradient noise relative to the signal, to first order linearly, so

    m = 1 + c · Σ_cuts Σ_directions e²

where the sum runs over the compressed tensors (the noise of independent cuts adds) and
``c`` converts added relative noise into added steps. Dense has ``e = 0`` and ``m = 1``.
The model is first order: it cannot say that a setting destroys learning altogether, and
it prices biased (top-k) and unbiased (quantization) errors with separate constants.

What is fitted, and from what. ``c`` (:data:`COST_PER_ERROR2`) comes from
``testbeds/results/convergence/`` (GPT-2 tiny and ResNet tiny, 3 stages, top-k on the
activations and gradients of the middle cut, 300 steps): for each run, ``m`` is the step at
which the dense run reaches its own final loss over the step at which it reaches the
compressed run's final loss, and ``Σ e²`` is the calibration's error on that cut at the
run's mean keep ratio. A least-squares slope through the origin gives ``c ≈ 3.2`` for
GPT-2 tiny and ``≈ 1.2`` for ResNet tiny (single runs range 0.8–4.6); the larger slope is
used, so the model errs towards dense.

Quantization's ``c`` (:data:`QUANT_COST_PER_ERROR2`) is priced apart: its error is unbiased
noise (block absmax, round to nearest on activations, stochastic rounding on gradients),
not top-k's systematic loss of the small entries. It comes from two split cells of
``testbeds/results/split/`` (two-sites-slow-split, 4-bit quantization on both directions of
the one 10 Mbps cut, 1,000 steps, the same data order as dense), ``m`` read as the median,
over the last 400 steps, of a step over the step at which dense's 50-step mean loss first
reaches the compressed run's:

- ResNet-18 (w16, 100 noisy shapes): ``Σ e² = 0.037``, ``m = 1.036`` (single points
  1.007-1.062, the loss falling steadily): a slope of 0.97;
- GPT-2 mini: ``Σ e² = 0.027``; its loss rises and falls with the data order, so the level
  crossings scatter (1.0-2.9); at the end it reached dense's final loss one step after
  dense (``m = 888 / 887``), its loss 0.1-0.4 % above dense's throughout.

The model uses 1.0, the ResNet's slope rounded up (as for top-k, the more sensitive model's):
4-bit quantization of one cut is priced at 2.7-3.7 % more steps, 8-bit at 0.01 %.

Refresh. During training each executor measures ``e`` of what it actually encodes (per
link, every step; :mod:`executor.compression`); :func:`convergence_cost` over those gives
the live ``m`` recorded in ``metrics.jsonl``.

Without a calibration (``fusion plan --no-calibrate``, or a node left out of it) a prior
stands in: top-k keeps at least the fraction ``r`` of the energy (``e² <= 1 - r``, the
worst case), and block quantization of roughly Gaussian blocks of 128 with absmax scales
rounds with ``e² ~= (3 / q_max)² / 12`` (absmax about three standard deviations; uniform
rounding error of variance ``Δ²/12``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusion.job_sections import COMPRESSION_CANDIDATES

logger = logging.getLogger(__name__)

#: ``c`` of ``m = 1 + c · Σ e²`` for top-k's errors, alone or with quantized values (see the
#: module docstring for the fit).
COST_PER_ERROR2 = 3.2
#: ``c`` for block quantization's errors (see the module docstring for the fit).
QUANT_COST_PER_ERROR2 = 1.0

#: One setting: (codec name, keep ratio, bits; 0 when not quantized).
Setting = tuple[str, float, int]
DENSE: Setting = ("none", 1.0, 0)
#: Candidates when no calibration names its own (:data:`fusion.job_sections.COMPRESSION_CANDIDATES`).
DEFAULT_CANDIDATES: tuple[Setting, ...] = COMPRESSION_CANDIDATES
DIRECTIONS = ("activations", "gradients")
_ERROR_KEY = {"activations": "activation_error", "gradients": "gradient_error"}
_BYTES_KEY = {"activations": "activation_bytes_ratio", "gradients": "gradient_bytes_ratio"}
_CODEC_S_KEY = {"activations": "activation_codec_s_per_byte", "gradients": "gradient_codec_s_per_byte"}


def cost_per_error2(codec: str) -> float:
    """``c`` for a codec's errors: :data:`QUANT_COST_PER_ERROR2` for ``quant``,
    :data:`COST_PER_ERROR2` for the others (top-k's bias dominates ``topk-quant``)."""
    return QUANT_COST_PER_ERROR2 if codec == "quant" else COST_PER_ERROR2


def convergence_cost(errors: Iterable[tuple[str, float]]) -> float:
    """``m = 1 + Σ c(codec) · e²`` over ``(codec, relative error)`` of every compressed
    tensor stream."""
    return 1.0 + sum(cost_per_error2(codec) * e * e for codec, e in errors if math.isfinite(e))


def prior_error2(setting: Setting) -> float:
    """The prior ``e²`` of a setting (module docstring), for tensors no calibration measured."""
    codec, ratio, bits = setting
    kept = min(max(ratio, 0.0), 1.0) if codec in ("topk", "topk-quant") else 1.0
    quant = 0.75 / float((2 ** (bits - 1) - 1) ** 2) if codec in ("quant", "topk-quant") and bits else 0.0
    return min(1.0, (1.0 - kept) + kept * quant)


def prior_bytes_ratio(setting: Setting) -> float:
    """Encoded over dense bytes of a float32 tensor: values (fp16 or ``bits``), indices
    (a bitmap or deltas, whichever is smaller) and per-128-entry scales."""
    codec, ratio, bits = setting
    if codec in ("none", "zstd"):
        return 1.0
    if codec == "fp16":
        return 0.5
    index = min(1.0 / 32.0, ratio / 2.0) if codec in ("topk", "topk-quant") else 0.0
    if codec == "topk":
        return min(1.0, ratio / 2.0 + index)
    scales = 4.0 / (128 * 4)
    kept = ratio if codec == "topk-quant" else 1.0
    return min(1.0, kept * (bits / 32.0 + scales) + index)


@dataclass(frozen=True)
class CutValue:
    """One value crossing a cut: its node and its bytes per micro-batch."""

    node: str
    size_bytes: int
    floating: bool
    """Whether codecs apply (integer tensors and non-tensors always travel dense)."""


class ErrorModel:
    """Relative errors and bytes ratios of the candidate settings on a cut's values: from a
    calibration (:meth:`compress.calibration.Calibration.to_dict`) where it measured the
    node, from the prior otherwise."""

    def __init__(self, calibration: Mapping[str, Any] | None = None) -> None:
        calibration = calibration or {}
        measured = [(str(c), float(r), int(b)) for c, r, b in calibration.get("settings", ())]
        #: The candidate settings: the calibration's, else :data:`DEFAULT_CANDIDATES`; dense first.
        self.settings: tuple[Setting, ...] = (DENSE, *(s for s in measured or DEFAULT_CANDIDATES if s != DENSE))
        self._index = {s: i for i, s in enumerate(measured)}
        self._nodes: Mapping[str, Mapping[str, Sequence[float]]] = calibration.get("nodes", {})

    @property
    def calibrated(self) -> bool:
        """Whether any node was measured."""
        return bool(self._nodes)

    def measured(self, node: str) -> bool:
        return node in self._nodes

    def _lookup(self, node: str, key: str, setting: Setting) -> float | None:
        entry = self._nodes.get(node)
        i = self._index.get(setting)
        if entry is None or i is None or key not in entry or i >= len(entry[key]):
            return None
        return float(entry[key][i])

    def cut(self, values: Sequence[CutValue], direction: str, setting: Setting) -> tuple[float, float]:
        """``(e², bytes ratio)`` of ``setting`` on a cut in ``direction``: ``e²`` weighted by
        each floating value's bytes, the ratio over all the cut's bytes (others stay dense)."""
        total = sum(v.size_bytes for v in values)
        if total <= 0 or setting == DENSE:
            return 0.0, 1.0
        err_weighted = 0.0
        float_bytes = 0
        sent = 0.0
        for v in values:
            if not v.floating:
                sent += v.size_bytes
                continue
            e = self._lookup(v.node, _ERROR_KEY[direction], setting)
            ratio = self._lookup(v.node, _BYTES_KEY[direction], setting)
            e2 = prior_error2(setting) if e is None else e * e
            sent += v.size_bytes * (prior_bytes_ratio(setting) if ratio is None else ratio)
            err_weighted += v.size_bytes * e2
            float_bytes += v.size_bytes
        e2 = err_weighted / float_bytes if float_bytes else 0.0
        return e2, min(1.0, sent / total)

    def codec_s(self, values: Sequence[CutValue], direction: str, setting: Setting) -> float:
        """Seconds per micro-batch the codec of ``setting`` spends on a cut's floating values
        in ``direction`` (encode, and decode on both sides): each value's bytes times the
        seconds per byte measured on its node; 0 for dense and where nothing was measured
        (a calibration from before the codecs were timed, or the prior)."""
        if setting == DENSE:
            return 0.0
        return sum(
            v.size_bytes * (self._lookup(v.node, _CODEC_S_KEY[direction], setting) or 0.0) for v in values if v.floating
        )


def cut_values(dag: Any, stages: Sequence[Any]) -> dict[tuple[int, int], list[CutValue]]:
    """The values crossing each cut ``(src stage, dst stage)`` of split stages (``StageSpec``)."""
    out: dict[tuple[int, int], list[CutValue]] = {}
    for spec in stages:
        for name, dsts in spec.outputs:
            node = dag.node(name)
            meta = node.value
            floating = meta.kind == "tensor" and (meta.dtype or "").startswith(("float", "bfloat"))
            for d in dsts:
                out.setdefault((spec.stage_idx, d), []).append(CutValue(name, int(node.out_bytes), floating))
    return out
