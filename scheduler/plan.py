"""The Plan: stages, their workers, and the cuts between them, as plain data.

A plan prints as a table, compares by value and round-trips JSON in the
``fusion plan --json`` form (Contracts in DESIGN.md). :func:`validate_plan` is the one
place that checks a plan is well formed. Planners (the baselines, later OP-Fence) produce
plans; the coordinator executes them. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fusion.errors import PlanError
from fusion.graph.ir import OpDag
from fusion.graph.split import StageSpec

#: Wire codecs a cut may use (see compress/).
CODECS = ("none", "zstd", "fp16", "topk", "quant", "topk-quant")
#: Codecs that quantize, and the bits they may use.
QUANTIZED = ("quant", "topk-quant")
BITS = (4, 8)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One stage: its nodes and the worker that runs it."""

    worker: str
    """Name of the worker hosting the stage."""
    nodes: tuple[str, ...]
    """Compute nodes of the stage, in topological order."""
    compute_s: float | None = None
    """Predicted compute seconds per micro-batch (forward + backward), once estimated."""
    peak_memory_bytes: int | None = None
    """Predicted peak memory of the worker for this stage, once estimated."""
    flops: int = 0
    """Forward + backward FLOPs of one micro-batch through the stage."""
    param_bytes: int = 0
    """Bytes of the parameters the stage holds."""


@dataclass(frozen=True, kw_only=True)
class CutPlan:
    """Values flowing from one stage to another, and how they are encoded."""

    src_stage: int
    dst_stage: int
    bytes: int
    """Bytes per micro-batch in the forward direction (the same crosses back as gradients)."""
    codec: str = "none"
    """Wire codec: one of :data:`CODECS`."""
    keep_ratio: float = 1.0
    """Fraction of entries kept by ``topk`` and ``topk-quant`` (1.0 = all)."""
    bits: int = 0
    """Bits per value of ``quant`` and ``topk-quant`` (4 or 8); 0 for the other codecs."""
    gradient_codec: str | None = None
    """Codec of the gradients sent back; None: the same setting as the activations."""
    gradient_keep_ratio: float | None = None
    gradient_bits: int | None = None
    convergence_cost: float = 1.0
    """Predicted steps-to-loss multiplier of this cut's compression (:mod:`scheduler.convergence`)."""
    time_to_loss_vs_dense: float = 1.0
    """Predicted time to loss with this cut's choice over the same plan with the cut dense."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A placement of a job's OP-DAG onto workers."""

    strategy: str
    """Planner that produced the plan (``uniform``, ``compute``, ``opfence`` ...)."""
    stages: tuple[StagePlan, ...]
    cuts: tuple[CutPlan, ...] = ()
    predicted_step_s: float | None = None
    """Modelled step time, when an estimator priced the plan."""
    planning_s: float = 0.0
    """Seconds the planner took."""
    micro_batches: int = 1
    schedule: str = "1f1b"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Planner-specific details (clusters, search statistics ...)."""

    def assignment(self) -> dict[str, int]:
        """Node → stage index."""
        return {n: i for i, s in enumerate(self.stages) for n in s.nodes}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [{**asdict(s), "nodes": list(s.nodes)} for s in self.stages]
        return d

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        try:
            return Plan(
                strategy=d["strategy"],
                stages=tuple(StagePlan(**{**s, "nodes": tuple(s["nodes"])}) for s in d["stages"]),
                cuts=tuple(CutPlan(**c) for c in d.get("cuts", ())),
                predicted_step_s=d.get("predicted_step_s"),
                planning_s=float(d.get("planning_s", 0.0)),
                micro_batches=int(d.get("micro_batches", 1)),
                schedule=d.get("schedule", "1f1b"),
                extra=dict(d.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"not a valid plan document: {e}") from e

    @staticmethod
    def from_json(text: str) -> Plan:
        try:
            return Plan.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from e

    def table(self) -> str:
        """A human-readable summary."""
        lines = [
            f"plan: {self.strategy}, {len(self.stages)} stages, {self.micro_batches} micro-batches ({self.schedule})"
        ]
        if self.predicted_step_s is not None:
            lines.append(f"predicted step time: {self.predicted_step_s:.4g}s")
        lines.append(
            f"{'stage':>5}  {'worker':<16} {'nodes':>6} {'params MB':>10} {'GFLOP/mb':>9} "
            f"{'compute s':>9} {'peak MB':>9}"
        )
        for i, s in enumerate(self.stages):
            compute = f"{s.compute_s:.4f}" if s.compute_s is not None else "-"
            peak = f"{s.peak_memory_bytes / 1e6:.1f}" if s.peak_memory_bytes is not None else "-"
            lines.append(
                f"{i:>5}  {s.worker:<16} {len(s.nodes):>6} {s.param_bytes / 1e6:>10.2f} {s.flops / 1e9:>9.3f} "
                f"{compute:>9} {peak:>9}"
            )
        lines.append(f"planning time: {self.planning_s:.3f}s")
        if self.extra.get("why"):
            lines.append(f"why: {self.extra['why']}")
        if self.cuts:
            lines.append(
                f"{'cut':>9}  {'MB/mb':>8} {'codec':<10} {'keep':>5} {'bits':>4}  {'grad codec':<10} {'keep':>5} "
                f"{'bits':>4} {'m':>6} {'T/dense':>7}"
            )
            for c in self.cuts:
                grad = (
                    (c.codec, c.keep_ratio, c.bits)
                    if c.gradient_codec is None
                    else (c.gradient_codec, c.gradient_keep_ratio or 1.0, c.gradient_bits or 0)
                )
                lines.append(
                    f"{c.src_stage:>3} -> {c.dst_stage:<3} {c.bytes / 1e6:>8.3f} {c.codec:<10} {c.keep_ratio:>5.2f} "
                    f"{c.bits or '-':>4}  {grad[0]:<10} {grad[1]:>5.2f} {grad[2] or '-':>4} "
                    f"{c.convergence_cost:>6.4f} {c.time_to_loss_vs_dense:>7.3f}"
                )
        summary = self.extra.get("compression")
        if isinstance(summary, dict) and summary.get("dense_step_s"):
            source = "errors calibrated on the job" if summary.get("calibrated") else "prior errors, not calibrated"
            lines.append(
                f"compression: step {summary['step_s']:.4g}s (dense {summary['dense_step_s']:.4g}s), "
                f"convergence cost m = {summary['convergence_cost']:.4f}, "
                f"predicted time to loss {summary['time_to_loss_vs_dense']:.3f}x dense ({source})"
            )
        if self.extra.get("compression_note"):
            lines.append(str(self.extra["compression_note"]))
        return "\n".join(lines)


def plan_from_stages(
    dag: OpDag,
    stages: Sequence[StageSpec],
    workers: Sequence[str],
    *,
    strategy: str,
    micro_batches: int,
    schedule: str,
    planning_s: float = 0.0,
    predicted_step_s: float | None = None,
    compute_s: Sequence[float] | None = None,
    peak_memory_bytes: Sequence[int] | None = None,
    codecs: Mapping[tuple[int, int], Sequence[Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Plan:
    """Describe split stages as a :class:`Plan` (FLOPs, parameter bytes, cut bytes).

    Args:
        compute_s: predicted compute seconds per micro-batch, per stage.
        peak_memory_bytes: predicted peak memory per stage.
        codecs: (src stage, dst stage) → (codec, keep ratio[, bits[, gradient codec, gradient
            keep ratio, gradient bits[, convergence cost, ...]]]) for cuts to compress
            (:class:`scheduler.compression.CutChoice`).
    """
    if len(workers) != len(stages):
        raise PlanError(f"{len(stages)} stages but {len(workers)} workers")
    sizes = dict(dag.iter_params())  # canonical name -> bytes
    stage_plans = []
    for i, (spec, worker) in enumerate(zip(stages, workers, strict=False)):
        flops = sum(dag.node(n).flops_fwd + dag.node(n).flops_bwd for n in spec.nodes)
        param_bytes = sum(sizes.get(name, 0) for name in {dag.tied_params.get(p, p) for p in spec.params})
        stage_plans.append(
            StagePlan(
                worker=worker,
                nodes=spec.nodes,
                flops=flops,
                param_bytes=param_bytes,
                compute_s=None if compute_s is None else float(compute_s[i]),
                peak_memory_bytes=None if peak_memory_bytes is None else int(peak_memory_bytes[i]),
            )
        )
    cut_bytes: dict[tuple[int, int], int] = {}
    for spec in stages:
        for name, dsts in spec.outputs:
            for d in dsts:
                cut_bytes[(spec.stage_idx, d)] = cut_bytes.get((spec.stage_idx, d), 0) + dag.node(name).out_bytes
    codecs = codecs or {}
    cuts = tuple(_cut_plan(s, d, b, codecs.get((s, d))) for (s, d), b in sorted(cut_bytes.items()))
    plan = Plan(
        strategy=strategy,
        stages=tuple(stage_plans),
        cuts=cuts,
        planning_s=planning_s,
        micro_batches=micro_batches,
        schedule=schedule,
        predicted_step_s=predicted_step_s,
        extra=dict(extra or {}),
    )
    validate_plan(plan, dag)
    return plan


def _cut_plan(src: int, dst: int, size: int, choice: Sequence[Any] | None) -> CutPlan:
    """A cut from a codec choice: ``(codec, keep ratio[, bits[, gradient codec, gradient keep
    ratio, gradient bits[, convergence cost[, activation error, gradient error[, time to loss
    vs dense]]]]])``."""
    if choice is None:
        return CutPlan(src_stage=src, dst_stage=dst, bytes=size)
    fields = (*choice, 0, None, None, None, 1.0, 0.0, 0.0, 1.0)
    return CutPlan(
        src_stage=src,
        dst_stage=dst,
        bytes=size,
        codec=fields[0],
        keep_ratio=float(fields[1]),
        bits=int(fields[2]),
        gradient_codec=fields[3],
        gradient_keep_ratio=None if fields[4] is None else float(fields[4]),
        gradient_bits=None if fields[5] is None else int(fields[5]),
        convergence_cost=float(fields[6]),
        time_to_loss_vs_dense=float(fields[9]),
    )


def validate_plan(plan: Plan, dag: OpDag) -> None:
    """Check that a plan covers every compute node exactly once and its cuts are sane."""
    seen: dict[str, int] = {}
    for i, s in enumerate(plan.stages):
        if not s.nodes:
            raise PlanError(f"stage {i} has no nodes")
        for n in s.nodes:
            if n not in dag or not dag.node(n).is_compute:
                raise PlanError(f"stage {i} names {n!r}, which is not a compute node of the DAG")
            if n in seen:
                raise PlanError(f"node {n!r} is on stages {seen[n]} and {i}")
            seen[n] = i
    missing = [n.name for n in dag.compute_nodes() if n.name not in seen]
    if missing:
        raise PlanError(f"the plan leaves {len(missing)} compute node(s) unplaced, e.g. {missing[:5]}")
    for c in plan.cuts:
        if (
            not (0 <= c.src_stage < len(plan.stages) and 0 <= c.dst_stage < len(plan.stages))
            or c.src_stage == c.dst_stage
        ):
            raise PlanError(f"cut {c.src_stage}->{c.dst_stage} does not join two different stages of the plan")
        settings = [(c.codec, c.keep_ratio, c.bits)]
        if c.gradient_codec is not None:
            settings.append((c.gradient_codec, c.gradient_keep_ratio or 1.0, c.gradient_bits or 0))
        for codec, keep_ratio, bits in settings:
            _check_setting(c, codec, keep_ratio, bits)
    if plan.micro_batches < 1:
        raise PlanError("micro_batches must be >= 1")


def _check_setting(c: CutPlan, codec: str, keep_ratio: float, bits: int) -> None:
    if codec not in CODECS:
        raise PlanError(f"cut {c.src_stage}->{c.dst_stage} has unknown codec {codec!r}; use one of {CODECS}")
    if not 0.0 < keep_ratio <= 1.0:
        raise PlanError(f"cut {c.src_stage}->{c.dst_stage} has keep_ratio {keep_ratio}; it must be in (0, 1]")
    if (codec in QUANTIZED) != (bits in BITS) or not (bits in BITS or bits == 0):
        raise PlanError(
            f"cut {c.src_stage}->{c.dst_stage} has codec {codec!r} with bits {bits}; "
            f"{' and '.join(QUANTIZED)} need bits in {BITS}, the other codecs 0"
        )
