"""Choose a planned placement's compression again, with measured codec errors.

The planner picks each cut's codec from the convergence model (:mod:`scheduler.compression`)
before anything is measured about the cuts it will make; once the placement is known, the
coordinator calibrates the codecs on exactly the values that cross its cuts
(:mod:`compress.calibration`) and calls :func:`with_compression`, which prices the same
stages on the same workers again and replaces only the cuts' settings and the summary.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from fusion.graph.ir import OpDag
from fusion.graph.split import split_stages
from scheduler.compression import compression_marks, compression_note, compression_summary, step_time_model
from scheduler.convergence import cut_values
from scheduler.plan import Plan, plan_from_stages
from scheduler.planner import PlanRequest, price
from scheduler.topology import Topology

logger = logging.getLogger(__name__)


def cut_nodes(dag: OpDag, plan: Plan) -> list[str]:
    """The nodes whose outputs cross a cut of ``plan``, in topological order."""
    stages = split_stages(dag, plan.assignment())
    crossing = {name for spec in stages for name, dsts in spec.outputs if dsts}
    return [n.name for n in dag.compute_nodes() if n.name in crossing]


def with_compression(dag: OpDag, topology: Topology, plan: Plan, request: PlanRequest) -> Plan:
    """``plan`` with each cut's codec chosen again under ``request`` (its calibration).

    Raises:
        PlanError: the plan does not fit ``dag`` or names a worker ``topology`` lacks.
    """
    stages = split_stages(dag, plan.assignment())
    stage_workers = [topology.index(s.worker) for s in plan.stages]
    est = price(dag, stages, stage_workers, topology, request)
    values = cut_values(dag, stages)
    step_s_of = step_time_model(dag, stages, stage_workers, topology, request)
    codecs = compression_marks(est, request, values=values, step_s_of=step_s_of)
    extra = {k: v for k, v in plan.extra.items() if k not in ("compression", "compression_note")}
    if request.compression != "none" and est.link_s:
        extra["compression"] = compression_summary(codecs, request, values=values, step_s_of=step_s_of)
    note = compression_note(est, request, codecs)
    if note:
        extra["compression_note"] = note
    rebuilt = plan_from_stages(
        dag,
        stages,
        [s.worker for s in plan.stages],
        strategy=plan.strategy,
        micro_batches=plan.micro_batches,
        schedule=plan.schedule,
        planning_s=plan.planning_s,
        predicted_step_s=plan.predicted_step_s,
        compute_s=[s.compute_s or 0.0 for s in plan.stages],
        peak_memory_bytes=[s.peak_memory_bytes or 0 for s in plan.stages],
        codecs=codecs,
        extra=extra,
    )
    return replace(rebuilt, stages=plan.stages)
