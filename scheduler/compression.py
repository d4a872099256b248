"""Which cuts of a plan are compressed, with which codec, ratio and bits.

A cut is *slow* when the modelled transfer of one micro-batch over it (forward activations
plus backward gradients, :mod:`scheduler.estimator`) takes longer than the slowest stage's
compute per micro-batch: then it, not compute, sets the pipeline's pace (DESIGN.md, the
step-time model), and compressing it pays. ``[compression] cuts = "all"`` compresses every
cut with the owner's setting whatever the links.

The choice is per cut as data, ``(codec, keep ratio, bits)``, so a controller can later
pick a different codec or bit width per cut. A job whose mode compresses but whose choice
marks no cut gets a one-line note saying why and what to change (:func:`compression_note`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from scheduler.estimator import Estimate

logger = logging.getLogger(__name__)

#: One cut's choice: codec name (compress/), keep ratio, bits per value (0: not quantized).
CutChoice = tuple[str, float, int]


class CompressionRequest(Protocol):
    """What the choice reads of a plan request."""

    compression: str
    keep_ratio: float
    min_keep_ratio: float
    bits: int
    compression_cuts: str


def compression_marks(est: Estimate, request: CompressionRequest) -> dict[tuple[int, int], CutChoice]:
    """The compressed cuts of a priced plan and their codec, ratio and bits.

    ``topk``/``quant``/``topk-quant`` use the owner's fixed setting. ``adatopk`` starts each
    cut where its transfer takes about as long as the slowest compute (bytes scale with the
    kept fraction): ``compute / link_s`` clamped to ``[min_keep_ratio, 1]``.
    """
    mode = request.compression
    if mode == "none" or not est.stage_compute_s:
        return {}
    compute = max(est.stage_compute_s)
    marks: dict[tuple[int, int], CutChoice] = {}
    for cut, link_s in est.link_s.items():
        if request.compression_cuts != "all" and not link_s > compute:
            continue
        if mode == "adatopk":
            ratio = 1.0 if link_s <= 0 else min(1.0, max(request.min_keep_ratio, compute / link_s))
            marks[cut] = ("topk", float(ratio), 0)
        elif mode == "topk":
            marks[cut] = ("topk", float(request.keep_ratio), 0)
        elif mode == "quant":
            marks[cut] = ("quant", 1.0, int(request.bits))
        else:
            marks[cut] = ("topk-quant", float(request.keep_ratio), int(request.bits))
    return marks


def compression_note(
    est: Estimate, request: CompressionRequest, marks: Mapping[tuple[int, int], CutChoice]
) -> str | None:
    """Why a compressing job compresses nothing, and what to change; None when it does
    compress something (or asked for nothing)."""
    if request.compression == "none" or marks:
        return None
    head = f"compression: mode {request.compression} on no cut"
    if not est.link_s:
        return f"{head}: the plan has a single stage, so nothing crosses a link"
    compute = max(est.stage_compute_s) if est.stage_compute_s else 0.0
    slowest = max(est.link_s.values())
    return (
        f"{head}: no cut is slower than the slowest stage's compute ({compute:.3g}s per micro-batch; "
        f'the slowest cut takes {slowest:.3g}s); set [compression] cuts = "all" to compress every cut'
    )
