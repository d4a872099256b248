"""Which cuts of a plan are compressed, with which codec, ratio and bits, per direction.

A cut is *slow* when the modelled transfer of one micro-batch over it (forward activations
plus backward gradients, :mod:`scheduler.estimator`) takes longer than the slowest stage's
compute per micro-batch: then it, not compute, sets the pipeline's pace (DESIGN.md, the
step-time model), and compressing it may pay. ``[compression] cuts = "all"`` makes every
cut eligible whatever the links.

- ``topk``, ``quant`` and ``topk-quant`` are the owner's fixed setting: it applies to every
  eligible cut, in the directions ``[compression] directions`` names.
- ``adatopk`` chooses per eligible cut and per direction (activations forward, gradients
  backward) the setting that minimises the predicted *time to loss*,

      T_loss(s) = (step_s(s) + M × Σ codec_s(s)) × m(s),

  where ``step_s`` is the estimator's step time with each cut's bytes scaled by its
  settings' encoded-over-dense ratio, ``codec_s`` the seconds the codecs spend per
  micro-batch on each compressed stream (calibrated, :mod:`compress.calibration`), counted
  once per micro-batch ``M`` as if on the pipeline's critical period (which errs towards
  dense: a codec beside a link-bound stage may hide in its idle time), and ``m`` the
  convergence cost of all the chosen errors together (:mod:`scheduler.convergence`).
  Dense (``m = 1``, no codec time) is always a candidate,
  so the choice is never predicted slower to the loss than dense. The search is coordinate
  descent: start dense, then for each cut in turn try every candidate on both directions
  together and then on each direction alone, keeping whatever lowers ``T_loss`` by at least
  :data:`MIN_GAIN`, until a pass changes nothing (at most :data:`MAX_PASSES`).

A job whose mode compresses but whose choice marks no cut gets a one-line note saying why
and what to change (:func:`compression_note`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from scheduler.convergence import (
    DENSE,
    DIRECTIONS,
    CutValue,
    ErrorModel,
    Setting,
    cost_per_error2,
)
from scheduler.estimator import Estimate, estimate, workload_from_dag

logger = logging.getLogger(__name__)

#: Coordinate-descent passes over the cuts at most.
MAX_PASSES = 3
#: A move must shorten the predicted time to loss by this fraction to be taken: the codecs'
#: compute is timed on one machine and the convergence model is coarse, so a marginal gain
#: is not worth an error.
MIN_GAIN = 0.02

#: Per cut, factors on its activation and gradient bytes -> predicted step seconds.
StepTime = Callable[[Mapping[tuple[int, int], tuple[float, float]]], float]


class CutChoice(NamedTuple):
    """One cut's choice: the activations' setting, the gradients' (None: the same), and what
    the convergence model predicts of them."""

    codec: str
    keep_ratio: float
    bits: int
    gradient_codec: str | None = None
    gradient_keep_ratio: float | None = None
    gradient_bits: int | None = None
    convergence_cost: float = 1.0
    """``1 + c (e_a² + e_g²)``: this cut's share of the steps-to-loss multiplier."""
    activation_error: float = 0.0
    """Predicted relative error of the activations sent (0 when sent dense)."""
    gradient_error: float = 0.0
    time_to_loss_vs_dense: float = 1.0
    """Predicted time to loss with this choice over the same plan with this cut dense."""

    def setting(self, direction: str) -> Setting:
        """The setting of ``activations`` or ``gradients``."""
        if direction == "gradients" and self.gradient_codec is not None:
            return (self.gradient_codec, float(self.gradient_keep_ratio or 1.0), int(self.gradient_bits or 0))
        return (self.codec, float(self.keep_ratio), int(self.bits))


class CompressionRequest(Protocol):
    """What the choice reads of a plan request."""

    compression: str
    keep_ratio: float
    min_keep_ratio: float
    bits: int
    compression_cuts: str
    compression_directions: tuple[str, ...]
    calibration: Mapping[str, Any] | None
    micro_batches: int


def eligible_cuts(est: Estimate, request: CompressionRequest) -> list[tuple[int, int]]:
    """The cuts the mode may compress: the slow ones, or all with ``cuts = "all"``."""
    if request.compression == "none" or not est.stage_compute_s:
        return []
    compute = max(est.stage_compute_s)
    return sorted(cut for cut, link_s in est.link_s.items() if request.compression_cuts == "all" or link_s > compute)


def owner_setting(request: CompressionRequest) -> Setting:
    """The fixed setting of ``topk``, ``quant`` and ``topk-quant``."""
    if request.compression == "topk":
        return ("topk", float(request.keep_ratio), 0)
    if request.compression == "quant":
        return ("quant", 1.0, int(request.bits))
    return ("topk-quant", float(request.keep_ratio), int(request.bits))


class _Costs:
    """``(e², bytes ratio)`` and codec seconds per (cut, direction, setting), computed once;
    ``micro_batches``: ``M`` of the step."""

    def __init__(
        self, errors: ErrorModel, values: Mapping[tuple[int, int], Sequence[CutValue]], micro_batches: int
    ) -> None:
        self.errors, self.values, self.micro_batches = errors, values, micro_batches
        #: ``(e², bytes ratio, codec seconds)`` per (cut, direction, setting).
        self._memo: dict[tuple[tuple[int, int], str, Setting], tuple[float, float, float]] = {}

    def _measure(self, cut: tuple[int, int], direction: str, setting: Setting) -> tuple[float, float, float]:
        key = (cut, direction, setting)
        if key not in self._memo:
            values = self.values.get(cut, ())
            self._memo[key] = (
                *self.errors.cut(values, direction, setting),
                self.errors.codec_s(values, direction, setting),
            )
        return self._memo[key]

    def __call__(self, cut: tuple[int, int], direction: str, setting: Setting) -> tuple[float, float]:
        e2, ratio, _ = self._measure(cut, direction, setting)
        return e2, ratio

    def codec_s(self, cut: tuple[int, int], direction: str, setting: Setting) -> float:
        return self._measure(cut, direction, setting)[2]

    def cost(self, cut: tuple[int, int], direction: str, setting: Setting) -> float:
        """``c · e²``: this stream's share of ``m - 1``."""
        return cost_per_error2(setting[0]) * self(cut, direction, setting)[0]

    def convergence_cost(self, chosen: Mapping[tuple[tuple[int, int], str], Setting]) -> float:
        """``m`` of all the chosen streams together."""
        return 1.0 + sum(self.cost(cut, d, s) for (cut, d), s in chosen.items())

    def step_s(self, chosen: Mapping[tuple[tuple[int, int], str], Setting], step_s_of: StepTime) -> float:
        """The step with the chosen settings: the estimator's with scaled bytes, plus the
        codecs' seconds once per micro-batch (module docstring)."""
        scales: dict[tuple[int, int], list[float]] = {}
        for (cut, direction), setting in chosen.items():
            scales.setdefault(cut, [1.0, 1.0])[DIRECTIONS.index(direction)] = self(cut, direction, setting)[1]
        codecs = sum(self.codec_s(cut, d, s) for (cut, d), s in chosen.items())
        return step_s_of({cut: (a, g) for cut, (a, g) in scales.items()}) + self.micro_batches * codecs

    def time_to_loss(self, chosen: Mapping[tuple[tuple[int, int], str], Setting], step_s_of: StepTime) -> float:
        return self.step_s(chosen, step_s_of) * self.convergence_cost(chosen)


def compression_marks(
    est: Estimate,
    request: CompressionRequest,
    *,
    values: Mapping[tuple[int, int], Sequence[CutValue]] | None = None,
    step_s_of: StepTime | None = None,
) -> dict[tuple[int, int], CutChoice]:
    """The compressed cuts of a priced plan and their per-direction settings.

    Args:
        est: the plan's dense estimate.
        request: the job's compression settings, and its calibration (or None: the prior).
        values: the values crossing each cut; default one floating value per cut of the
            estimate's bytes, which only the prior describes.
        step_s_of: the step time with scaled cut bytes; default :func:`approximate_step_time`.
    """
    cuts = eligible_cuts(est, request)
    if not cuts:
        return {}
    values = values if values is not None else {c: [CutValue(f"cut{c}", est.link_bytes.get(c, 0), True)] for c in cuts}
    costs = _Costs(ErrorModel(request.calibration), values, request.micro_batches)
    directions = [d for d in DIRECTIONS if d in request.compression_directions]
    step_s_of = step_s_of or approximate_step_time(est, request.micro_batches)
    if request.compression == "adatopk":
        allowed = [
            s for s in costs.errors.settings if s[0] not in ("topk", "topk-quant") or s[1] >= request.min_keep_ratio
        ]
        chosen = choose(cuts, directions, costs, step_s_of, allowed)
    else:
        fixed = owner_setting(request)
        chosen = {(cut, d): fixed for cut in cuts for d in directions}
    t_loss = costs.time_to_loss(chosen, step_s_of)
    marks = {}
    for cut in cuts:
        act = chosen.get((cut, "activations"), DENSE)
        grad = chosen.get((cut, "gradients"), DENSE)
        if act == DENSE and grad == DENSE:
            continue
        ea2, _ = costs(cut, "activations", act)
        eg2, _ = costs(cut, "gradients", grad)
        without = {**chosen, **{(cut, d): DENSE for d in directions}}
        # A fixed setting is the cut's for both directions; [compression] directions (the
        # executor's flags) say which use it.
        fixed_mode = request.compression != "adatopk"
        marks[cut] = CutChoice(
            *(owner_setting(request) if fixed_mode else act),
            *((None, None, None) if fixed_mode or grad == act else grad),
            convergence_cost=1.0 + costs.cost(cut, "activations", act) + costs.cost(cut, "gradients", grad),
            activation_error=ea2**0.5,
            gradient_error=eg2**0.5,
            time_to_loss_vs_dense=t_loss / costs.time_to_loss(without, step_s_of),
        )
    return marks


def choose(
    cuts: Sequence[tuple[int, int]],
    directions: Sequence[str],
    costs: _Costs,
    step_s_of: StepTime,
    settings: Sequence[Setting],
) -> dict[tuple[tuple[int, int], str], Setting]:
    """Coordinate descent on the predicted time to loss (module docstring), from dense,
    over ``settings`` (those keeping at least ``min_keep_ratio``)."""
    chosen = {(cut, d): DENSE for cut in cuts for d in directions}
    best = costs.time_to_loss(chosen, step_s_of)
    for _ in range(MAX_PASSES):
        changed = False
        for cut in cuts:
            # Both directions at once first: a cut is busy for its slower direction, so
            # compressing one alone may not shorten the step at all.
            moves = [dict.fromkeys([(cut, d) for d in directions], s) for s in settings]
            moves += [{(cut, d): s} for d in directions for s in settings]
            for move in moves:
                trial = {**chosen, **move}
                if trial == chosen:
                    continue
                t = costs.time_to_loss(trial, step_s_of)
                if t < best * (1.0 - MIN_GAIN):
                    chosen, best, changed = trial, t, True
        if not changed:
            break
    return chosen


def compression_summary(
    marks: Mapping[tuple[int, int], CutChoice],
    request: CompressionRequest,
    *,
    values: Mapping[tuple[int, int], Sequence[CutValue]],
    step_s_of: StepTime,
) -> dict[str, float | bool]:
    """What the plan prints of its compression: dense and compressed step time, the total
    convergence cost ``m``, the predicted time to loss over dense's, and whether the errors
    were calibrated (else the prior)."""
    errors = ErrorModel(request.calibration)
    costs = _Costs(errors, values, request.micro_batches)
    chosen = _chosen_of(marks, request)
    dense = step_s_of({})
    t_loss = costs.time_to_loss(chosen, step_s_of)
    m = costs.convergence_cost(chosen)
    return {
        "dense_step_s": dense,
        "step_s": t_loss / m,
        "convergence_cost": m,
        "time_to_loss_vs_dense": t_loss / dense if dense > 0 else 1.0,
        "calibrated": errors.calibrated,
    }


def _chosen_of(
    marks: Mapping[tuple[int, int], CutChoice], request: CompressionRequest
) -> dict[tuple[tuple[int, int], str], Setting]:
    return {
        (cut, d): choice.setting(d)
        for cut, choice in marks.items()
        for d in DIRECTIONS
        if d in request.compression_directions
    }


def approximate_step_time(est: Estimate, micro_batches: int) -> StepTime:
    """The step time with scaled cut bytes, from a dense estimate alone: each cut's busy
    time scales with its larger factor; the pipeline period and the critical path move by
    the change (used where the planner's full estimator is not at hand)."""
    compute = max(est.stage_compute_s, default=0.0)
    old_links = max(est.link_s.values(), default=0.0)
    other = compute if old_links >= est.bottleneck_s else est.bottleneck_s

    def step_s(scales: Mapping[tuple[int, int], tuple[float, float]]) -> float:
        links = {cut: t * max(scales.get(cut, (1.0, 1.0))) for cut, t in est.link_s.items()}
        period = max(other, max(links.values(), default=0.0))
        path = sum(links[c] - t for c, t in est.link_s.items())
        return est.step_s + (micro_batches - 1) * (period - est.bottleneck_s) + path

    return step_s


def step_time_model(
    dag: Any, stages: Sequence[Any], stage_workers: Sequence[int], topology: Any, request: Any
) -> StepTime:
    """The estimator's step time of split stages with scaled cut bytes (one workload, priced
    again per call)."""
    import numpy as np

    built: list[Any] = []  # the workload, built on the first call (jobs without compression never call)

    def step_s(scales: Mapping[tuple[int, int], tuple[float, float]]) -> float:
        if not built:
            wl = workload_from_dag(dag, optimizer=request.optimizer, momentum=request.momentum, step=request.step_costs)
            stage_of = {n: s.stage_idx for s in stages for n in s.nodes}
            built.extend([wl, np.array([stage_of[name] for name in wl.names], dtype=np.int64)])
        wl, unit_stage = built
        return estimate(
            wl,
            unit_stage,
            stage_workers,
            topology,
            micro_batches=request.micro_batches,
            schedule=request.schedule,
            cut_bytes_scale=scales,
        ).step_s

    return step_s


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
    if eligible_cuts(est, request):
        return (
            f"{head}: on every eligible cut dense has the shortest predicted time to loss (no setting's "
            "faster steps outweigh the extra steps its error costs); a fixed mode (topk, quant) overrides this"
        )
    compute = max(est.stage_compute_s) if est.stage_compute_s else 0.0
    slowest = max(est.link_s.values())
    return (
        f"{head}: no cut is slower than the slowest stage's compute ({compute:.3g}s per micro-batch; "
        f'the slowest cut takes {slowest:.3g}s); set [compression] cuts = "all" to compress every cut'
    )
