"""One entry point for every planning strategy: DAG + topology → :class:`~scheduler.plan.Plan`.

``uniform`` cuts the original DAG into equal node counts over the workers in join order;
``compute``, ``opfence`` and ``exhaustive`` plan on a coarsened DAG (units along the
module hierarchy) and map the result back to nodes. Every plan is priced by the same
estimator on the original DAG, so plans from different strategies compare like with like.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusion.config import JobSpec
from fusion.errors import InsufficientMemoryError, PlanError
from fusion.graph.ir import OpDag
from fusion.graph.split import normalize_assignment, split_stages
from fusion.memory import format_bytes
from scheduler.baselines import uniform_assignment
from scheduler.compression import compression_marks, compression_note, compression_summary, step_time_model
from scheduler.convergence import cut_values
from scheduler.estimator import Estimate, StepCosts, estimate, workload_from_dag
from scheduler.explain import why_left_out
from scheduler.partition import (
    Placement,
    compute_placement,
    exhaustive_placement,
    memory_advice,
    opfence_placement,
)
from scheduler.plan import Plan, plan_from_stages
from scheduler.topology import Topology

logger = logging.getLogger(__name__)

STRATEGIES = ("opfence", "uniform", "compute", "exhaustive")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What a planner needs to know about the job besides its DAG."""

    strategy: str = "opfence"
    """``opfence``, ``uniform``, ``compute`` or ``exhaustive``."""
    micro_batches: int = 1
    schedule: str = "1f1b"
    optimizer: str = "adamw"
    momentum: float = 0.0
    compression: str = "none"
    """Job compression mode: ``none``, ``topk``, ``adatopk``, ``quant`` or ``topk-quant``."""
    keep_ratio: float = 0.1
    """Fixed keep ratio for ``topk``."""
    min_keep_ratio: float = 0.01
    """Lower bound of AdaTopK's ratio."""
    bits: int = 8
    """Bits per value of ``quant`` and ``topk-quant``."""
    compression_cuts: str = "slow"
    """``slow`` or ``all``: which cuts the mode compresses (:mod:`scheduler.compression`)."""
    compression_directions: tuple[str, ...] = ("activations", "gradients")
    """Which directions the mode compresses."""
    calibration: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    """Measured codec errors on the job's tensors (:mod:`compress.calibration`); None: the
    convergence model's prior (:mod:`scheduler.convergence`)."""
    step_costs: StepCosts = field(default_factory=StepCosts)
    max_units: int = 256
    """Coarsen the DAG to at most this many units before searching."""
    time_budget_s: float | None = None
    """Local-search budget of OP-Fence: :data:`DEFAULT_BUDGET_S` plus 4 ms per worker unless
    given. The search stops sooner once no move improves its placement."""
    memory_scale: float = 1.0
    """Factor on every predicted peak (>= 1): what training measured over what the
    estimator predicted, once a stage's real peak outgrew its plan."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlanError(f"unknown plan strategy {self.strategy!r}; choose one of {STRATEGIES}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise PlanError(f"unknown schedule {self.schedule!r}; choose gpipe or 1f1b")
        if self.micro_batches < 1:
            raise PlanError("micro_batches must be >= 1")
        if not (1.0 <= self.memory_scale < float("inf")):
            raise PlanError(f"memory_scale must be a finite number >= 1, got {self.memory_scale}")


def request_for_job(spec: JobSpec, *, strategy: str | None = None, step_costs: StepCosts | None = None) -> PlanRequest:
    """The planner's view of a job: its ``[train]``, ``[plan]`` and ``[compression]``."""
    return PlanRequest(
        strategy=strategy or spec.plan.strategy,
        micro_batches=spec.train.micro_batches,
        schedule=spec.train.schedule,
        optimizer=spec.train.optimizer,
        momentum=spec.train.momentum,
        compression=spec.compression.mode,
        keep_ratio=spec.compression.keep_ratio,
        min_keep_ratio=spec.compression.min_keep_ratio,
        bits=spec.compression.bits,
        compression_cuts=spec.compression.cuts,
        compression_directions=tuple(spec.compression.directions),
        step_costs=step_costs or StepCosts(),
    )


def make_plan(dag: OpDag, topology: Topology, request: PlanRequest) -> Plan:
    """Plan ``dag`` onto ``topology`` with the requested strategy.

    A plan that leaves workers out says why in ``extra["why"]`` (one line,
    :mod:`scheduler.explain`). No stage is planned over its worker's memory cap: the predicted peaks (times
    ``request.memory_scale``) are checked on the original DAG, whatever the strategy, and a
    job no placement fits raises :class:`~fusion.errors.InsufficientMemoryError` naming the
    memory needed against what the workers lend.
    """
    t0 = time.perf_counter()
    if len(topology) == 0:
        raise PlanError("no workers to plan onto")
    lent = topology
    extra: dict[str, object] = {}
    coarse: OpDag | None = None
    search_scale = request.memory_scale
    for attempt in range(SEARCH_ROUNDS):
        topology = scaled_caps(lent, search_scale)
        if request.strategy == "uniform":
            stages, stage_workers = uniform_stages(dag, len(topology))
        else:
            stages, stage_workers, extra, coarse = searched_stages(dag, topology, request, search_scale, lent)
        est = price(dag, stages, stage_workers, topology, request)
        peaks = {w: int(math.ceil(need * request.memory_scale)) for w, need in est.peak_memory_bytes.items()}
        overshoot = max(
            (need / cap for w, need in peaks.items() if (cap := lent.workers[w].memory_bytes) is not None),
            default=0.0,
        )
        if overshoot <= 1.0 or request.strategy == "uniform" or attempt + 1 == SEARCH_ROUNDS:
            break
        # The search priced a coarsened DAG; the nodes themselves need more: search again
        # against caps tightened by the overshoot.
        search_scale *= overshoot * 1.01
    check_caps(peaks, lent, dag, request)
    values = cut_values(dag, stages)
    step_s_of = step_time_model(dag, stages, stage_workers, topology, request)
    codecs = compression_marks(est, request, values=values, step_s_of=step_s_of)
    if request.compression != "none" and est.link_s:
        extra["compression"] = compression_summary(codecs, request, values=values, step_s_of=step_s_of)
    note = compression_note(est, request, codecs)
    if note:
        extra["compression_note"] = note
    wider = extra.pop("wider", None)
    if len(stage_workers) < len(topology):
        extra["why"] = _why(dag, coarse, topology, request, est, stage_workers, wider)
    return plan_from_stages(
        dag,
        stages,
        [topology.workers[w].name for w in stage_workers],
        strategy=request.strategy,
        micro_batches=request.micro_batches,
        schedule=request.schedule,
        planning_s=time.perf_counter() - t0,
        predicted_step_s=est.step_s,
        compute_s=est.stage_compute_s,
        peak_memory_bytes=[peaks[w] for w in stage_workers],
        codecs=codecs,
        extra=extra,
    )


#: OP-Fence's default search budget before its per-worker share (seconds): room for the local
#: search to reach its optimum on jobs of a few hundred units, since a search the deadline stops
#: gives a plan that depends on how busy the machine is (timings: testbeds/results/split/README.md).
DEFAULT_BUDGET_S = 5.0

#: Searches over tightened caps before a plan whose nodes need more than its coarse units is refused.
SEARCH_ROUNDS = 3


def uniform_stages(dag: OpDag, num_workers: int) -> tuple[list, list[int]]:
    """``uniform``: equal node counts over the first workers in join order."""
    num_stages = min(num_workers, len(dag.compute_nodes()))
    # Values that cannot cross a stage boundary pull their consumers along, which can
    # empty a stage when there are nearly as many stages as nodes: drop those stages
    # (and their workers) rather than fail.
    assignment = normalize_assignment(dag, uniform_assignment(dag, num_stages))
    stage_workers = sorted(set(assignment.values()))
    renumber = {s: i for i, s in enumerate(stage_workers)}
    return split_stages(dag, {n: renumber[s] for n, s in assignment.items()}), stage_workers


def searched_stages(
    dag: OpDag, topology: Topology, request: PlanRequest, search_scale: float, lent: Topology
) -> tuple[list, list[int], dict[str, object], OpDag]:
    """``compute``, ``opfence``, ``exhaustive``: a search on the coarsened DAG, mapped back to
    nodes; also the coarsened DAG the search's placements index."""
    coarse = dag.coarsen(request.max_units)
    wl = workload_from_dag(coarse, optimizer=request.optimizer, momentum=request.momentum, step=request.step_costs)
    kwargs = {"micro_batches": request.micro_batches, "schedule": request.schedule}
    extra: dict[str, object] = {}
    try:
        if request.strategy == "opfence":
            budget = request.time_budget_s
            if budget is None:
                budget = DEFAULT_BUDGET_S + 0.004 * len(topology)
            placement, extra = opfence_placement(wl, topology, time_budget_s=budget, **kwargs)
        elif request.strategy == "compute":
            placement = compute_placement(wl, topology, **kwargs)
        else:
            placement = exhaustive_placement(wl, topology, **kwargs)
    except InsufficientMemoryError as e:
        raise rescaled(e, search_scale, lent) from e
    unit_stage = placement.unit_stage(len(wl))
    assignment = coarse.expand_assignment({name: int(unit_stage[i]) for i, name in enumerate(wl.names)})
    return split_stages(dag, assignment), list(placement.workers), extra, coarse


def rescaled(e: InsufficientMemoryError, memory_scale: float, lent: Topology) -> InsufficientMemoryError:
    """``e`` of a search over caps divided by ``memory_scale``, in real caps and scaled needs."""
    if memory_scale == 1.0:
        return e
    return InsufficientMemoryError(
        f"{e} (predicted peaks scaled by {memory_scale:.2f}, as training measured them)",
        needed_bytes=int(e.needed_bytes * memory_scale),
        lent_bytes=sum(w.memory_bytes or 0 for w in lent.workers),
        num_workers=e.num_workers,
    )


def scaled_caps(topology: Topology, memory_scale: float) -> Topology:
    """``topology`` with every memory cap divided by ``memory_scale`` (planning against the
    caps so is planning predicted peaks times the scale against the real ones)."""
    if memory_scale == 1.0:
        return topology
    workers = tuple(
        w if w.memory_bytes is None else dataclasses.replace(w, memory_bytes=max(1, int(w.memory_bytes / memory_scale)))
        for w in topology.workers
    )
    return dataclasses.replace(topology, workers=workers)


def check_caps(peaks: dict[int, int], topology: Topology, dag: OpDag, request: PlanRequest) -> None:
    """Raise :class:`InsufficientMemoryError` if a worker's predicted peak exceeds its cap.

    The search plans on a coarsened DAG (and ``uniform`` not at all for memory); this is the
    verdict on the nodes themselves."""
    over = {
        w: need for w, need in peaks.items() if (cap := topology.workers[w].memory_bytes) is not None and need > cap
    }
    if not over:
        return
    caps = [w.memory_bytes for w in topology.workers if w.memory_bytes is not None]
    lent = sum(caps)
    w, need = max(over.items(), key=lambda kv: kv[1] - (topology.workers[kv[0]].memory_bytes or 0))
    cap = topology.workers[w].memory_bytes or 0
    hint = ", or plan with opfence (it places within the caps)" if request.strategy == "uniform" else ""
    raise InsufficientMemoryError(
        f"the {request.strategy} plan needs {format_bytes(need)} on worker {topology.workers[w].name}, which lends "
        f"{format_bytes(cap)} ({need} > {cap} bytes; the {len(caps)} workers lend {format_bytes(lent)} in all); "
        f"add workers with more memory or {memory_advice(request.schedule)}{hint}",
        needed_bytes=max(lent + need - cap, sum(peaks.values())),
        lent_bytes=lent,
        num_workers=len(caps),
    )


def _why(
    dag: OpDag,
    coarse: OpDag | None,
    topology: Topology,
    request: PlanRequest,
    est: Estimate,
    stage_workers: list[int],
    wider: object,
) -> str:
    """Why the plan leaves workers out (:func:`scheduler.explain.why_left_out`); ``wider``:
    OP-Fence's fastest placement over more workers (unit bounds and workers of ``coarse``)."""
    names = [topology.workers[w].name for w in stage_workers]
    left_out = [w.name for i, w in enumerate(topology.workers) if i not in stage_workers]
    common = {"micro_batches": request.micro_batches}
    if isinstance(wider, dict) and "bounds" in wider and coarse is not None:
        placement = Placement(tuple(wider["bounds"]), tuple(wider["workers"]))
        units = [n.name for n in coarse.compute_nodes()]
        unit_stage = placement.unit_stage(len(units))
        wider_stages = split_stages(dag, coarse.expand_assignment(dict(zip(units, map(int, unit_stage), strict=True))))
        wider_est = price(dag, wider_stages, list(placement.workers), topology, request)
        wider_names = [topology.workers[w].name for w in placement.workers]
        return why_left_out(est, names, left_out, wider=wider_est, wider_workers=wider_names, **common)
    if isinstance(wider, dict):
        reason = (
            "every plan over more workers the search priced exceeds a worker's memory"
            if wider.get("tried")
            else "the search priced no plan over more workers"
        )
    elif request.strategy == "uniform":
        reason = f"strategy uniform cuts the {len(dag.compute_nodes())} nodes into {len(names)} non-empty stages"
    else:
        reason = f"strategy {request.strategy} placed no stage there"
    return why_left_out(est, names, left_out, no_wider=reason, **common)


def price(dag: OpDag, stages: list, stage_workers: list[int], topology: Topology, request: PlanRequest) -> Estimate:
    """The estimator's verdict on split stages, on the original DAG."""
    wl = workload_from_dag(dag, optimizer=request.optimizer, momentum=request.momentum, step=request.step_costs)
    stage_of = {n: s.stage_idx for s in stages for n in s.nodes}
    unit_stage = np.array([stage_of[name] for name in wl.names], dtype=np.int64)
    return estimate(
        wl, unit_stage, stage_workers, topology, micro_batches=request.micro_batches, schedule=request.schedule
    )
