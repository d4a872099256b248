"""Scheduler benchmark: how good OP-Fence's plans are, and how fast it makes them.

    python -m testbeds.bench.scheduler                  # all three parts, about 30 s on 2 cores
    python -m testbeds.bench.scheduler --instances 20 --skip-xl --json

Everything here is *predicted* by the workload estimator (:mod:`scheduler.estimator`);
nothing is trained. The numbers mean:

- **Optimality** (part a): on ``--instances`` random small instances (4–8 units, 2–4
  workers in 1–4 bandwidth clusters, 1–8 micro-batches, some with memory caps),
  OP-Fence's predicted step time divided by the optimum under the same estimator, found by
  :func:`~scheduler.partition.exhaustive_placement`. ``1.0`` is optimal; the median, 90th
  percentile and worst ratio are printed with how many instances were solved optimally
  (ratio <= 1.0001). Targets: median <= 1.01, worst <= 1.05. ``no plan`` (JSON ``null``)
  means OP-Fence raised ``PlanError`` on an instance the exhaustive search solved. The
  worst instances are listed by index ``i``: the ``i``-th draw (0-based) of
  :func:`random_instance` from ``numpy.random.default_rng(seed)`` replays one.
- **Shipped topologies** (part b): predicted seconds per training step of GPT-2 small
  (micro-batch 4 × 1024 tokens) and GPT-2 XL (1 × 1024) with 8 micro-batches (1F1B, AdamW)
  on every ``testbeds/topologies/*.toml``, planned by ``opfence``, ``uniform`` (equal node
  counts, join order) and ``compute`` (compute-balanced, ignores links). ``x uniform`` and
  ``x compute`` are the baseline's step time over OP-Fence's (> 1: OP-Fence is faster). A
  ``*`` marks a plan whose predicted peak memory exceeds a worker's cap (``uniform`` does
  not look at memory), ``-`` a strategy that found no plan that fits.
- **Planning time** (part c): wall seconds of ``make_plan(strategy="opfence")`` for GPT-2
  XL on synthetic clustered topologies of 48, 256 and 1,024 workers (20–120 TFLOP/s,
  16–80 GiB, 1–10 Gbps inside a cluster, 8 Mbps–1 Gbps between), with the predicted step
  time, the stages used, the clusters OP-Fence found against those planted, and the
  estimator evaluations the search made. Targets: <= 1 s, <= 5 s, <= 30 s. Building the
  ``Topology`` itself is timed apart (``topology s``).

Models are captured on the meta device, so no weights are allocated. ``--skip-xl`` drops
GPT-2 XL from part b and skips part c.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusion.errors import PlanError
from scheduler.estimator import StepCosts, Workload
from scheduler.partition import Objective, Placement, exhaustive_placement, opfence_placement
from scheduler.topology import GIB, Topology, WorkerSpec

logger = logging.getLogger(__name__)

TOPOLOGY_DIR = Path(__file__).resolve().parents[1] / "topologies"

#: Part a targets: OP-Fence over the exhaustive optimum.
TARGET_MEDIAN_RATIO = 1.01
TARGET_WORST_RATIO = 1.05
#: A ratio at most this is counted as optimal (float noise in the estimator).
OPTIMAL_RATIO = 1.0001
#: Part c targets: workers -> seconds of make_plan.
TARGET_PLANNING_S = {48: 1.0, 256: 5.0, 1024: 30.0}

#: Part b jobs: (label, GPT-2 preset, micro-batch size, sequence length).
JOBS = (("gpt2-small", "small", 4, 1024), ("gpt2-xl", "xl", 1, 1024))
#: Part c job and topology sizes.
PLANNING_JOB = ("gpt2-xl", "xl", 1, 1024)
PLANNING_SIZES = (48, 256, 1024)
MICRO_BATCHES = 8
STRATEGIES = ("opfence", "uniform", "compute")

MBPS = 1e6 / 8  # bytes/s in one megabit/s
GBPS = 1e9 / 8


# ---------------------------------------------------------------- random instances
@dataclass(frozen=True)
class Instance:
    """One small planning problem: a workload, a topology and the pipeline settings."""

    workload: Workload
    topology: Topology
    micro_batches: int
    schedule: str


def random_workload(rng: np.random.Generator, num_units: int) -> Workload:
    """A chain of units with random costs and tensor sizes, plus some skip edges (i -> i+3).

    Times are at 1 TFLOP/s; backward is 1.5–2.5× forward; each unit owns 1–100 MB of
    parameters and saves 0.1–10 MB of activations per micro-batch.
    """
    fwd_s = rng.uniform(1e-3, 20e-3, num_units)
    bwd_s = fwd_s * rng.uniform(1.5, 2.5, num_units)
    edges: list[tuple[int, int, int, int]] = []
    for i in range(num_units - 1):
        size = int(rng.choice([1e4, 1e5, 1e6, 1e7]))
        edges.append((i, i + 1, size, size))
        if i + 3 < num_units and rng.random() < 0.3:
            skip = int(rng.choice([1e4, 1e6]))
            edges.append((i, i + 3, skip, skip))
    return Workload(
        names=[f"u{i}" for i in range(num_units)],
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        flops=(fwd_s + bwd_s) * 1e12,
        saved_bytes=rng.uniform(1e5, 1e7, num_units),
        params=[[(i, int(rng.uniform(1e6, 1e8)))] for i in range(num_units)],
        edges=edges,
        reference_flops=1e12,
        step=StepCosts(),
        input_bytes=np.zeros(num_units),
        output_unit=num_units - 1,
        output_bytes=int(rng.choice([1e4, 1e6])),
    )


def clustered_topology(
    cluster_of: np.ndarray,
    *,
    flops: np.ndarray,
    memory_bytes: list[int | None],
    intra_bytes_per_s: np.ndarray,
    inter_bytes_per_s: np.ndarray,
    intra_latency_s: float,
    inter_latency_s: float,
) -> Topology:
    """Workers labelled by ``cluster_of``; links take their cluster's (or cluster pair's) speed.

    ``intra_bytes_per_s`` has one entry per cluster, ``inter_bytes_per_s`` is a symmetric
    cluster × cluster matrix.
    """
    n = len(cluster_of)
    same = cluster_of[:, None] == cluster_of[None, :]
    bandwidth = np.where(same, intra_bytes_per_s[cluster_of][:, None], inter_bytes_per_s[cluster_of][:, cluster_of])
    latency = np.where(same, intra_latency_s, inter_latency_s)
    workers = [
        WorkerSpec(name=f"w{i}", cluster=f"c{cluster_of[i]}", flops=float(flops[i]), memory_bytes=memory_bytes[i])
        for i in range(n)
    ]
    return Topology.from_measurements(workers, latency, bandwidth)


def _symmetric_choice(rng: np.random.Generator, values: list[float], k: int) -> np.ndarray:
    m = rng.choice(values, (k, k))
    return np.minimum(m, m.T)


def random_instance(rng: np.random.Generator, *, memory_caps: bool = True) -> Instance:
    """A small instance the exhaustive planner solves in well under a second.

    4–8 units on 2–4 workers (0.5–2 TFLOP/s) in up to 4 clusters (10 Gbps or 1 Gbps inside;
    8 Mbps, 100 Mbps or 1 Gbps between). With ``memory_caps``, half the instances cap every
    worker's memory at 0.4–1.5× what the whole model needs on one worker, so some must be
    split; such an instance is redrawn when the caps leave no feasible placement at all.
    """
    while True:
        num_units = int(rng.integers(4, 9))
        num_workers = int(rng.integers(2, 5))
        micro_batches = int(rng.choice([1, 4, 8]))
        schedule = str(rng.choice(["1f1b", "gpipe"]))
        workload = random_workload(rng, num_units)
        k = int(rng.integers(1, num_workers + 1))
        cluster_of = rng.integers(0, k, num_workers)
        flops = rng.choice([0.5e12, 1e12, 2e12], num_workers)
        memory: list[int | None] = [None] * num_workers
        if memory_caps and rng.random() < 0.5:
            whole = _single_worker_need(workload, micro_batches, schedule)
            memory = [int(whole * rng.uniform(0.4, 1.5)) for _ in range(num_workers)]
        topology = clustered_topology(
            cluster_of,
            flops=flops,
            memory_bytes=memory,
            intra_bytes_per_s=rng.choice([10 * GBPS, 1 * GBPS], k),
            inter_bytes_per_s=_symmetric_choice(rng, [8 * MBPS, 100 * MBPS, 1 * GBPS], k),
            intra_latency_s=1e-4,
            inter_latency_s=0.03,
        )
        instance = Instance(workload, topology, micro_batches, schedule)
        if all(m is None for m in memory) or _feasible(instance):
            return instance


def _single_worker_need(workload: Workload, micro_batches: int, schedule: str) -> int:
    """Peak bytes of the whole workload as one stage on an uncapped worker."""
    solo = Topology.from_measurements([WorkerSpec(name="solo", cluster="solo")], [[0.0]], [[math.inf]])
    obj = Objective(workload, solo, micro_batches=micro_batches, schedule=schedule)
    return obj.estimate(Placement((0, len(workload)), (0,))).peak_memory_bytes[0]


def _feasible(instance: Instance) -> bool:
    try:
        exhaustive_placement(
            instance.workload, instance.topology, micro_batches=instance.micro_batches, schedule=instance.schedule
        )
    except PlanError:
        return False
    return True


# ---------------------------------------------------------------- part a
def optimality(num_instances: int, seed: int) -> dict[str, Any]:
    """OP-Fence's predicted step time over the exhaustive optimum on random small instances."""
    rng = np.random.default_rng(seed)
    ratios: list[float] = []
    opfence_s: list[float] = []
    for _ in range(num_instances):
        inst = random_instance(rng)
        obj = Objective(inst.workload, inst.topology, micro_batches=inst.micro_batches, schedule=inst.schedule)
        t0 = time.perf_counter()
        try:
            placement, _ = opfence_placement(
                inst.workload,
                inst.topology,
                micro_batches=inst.micro_batches,
                schedule=inst.schedule,
                time_budget_s=1.0,
            )
            found = obj(placement)
        except PlanError:  # the optimum exists (the generator checked), so this counts as a miss
            found = math.inf
        opfence_s.append(time.perf_counter() - t0)
        best = exhaustive_placement(
            inst.workload, inst.topology, micro_batches=inst.micro_batches, schedule=inst.schedule
        )
        ratios.append(found / obj(best))
    worst_misses = sorted((i for i, r in enumerate(ratios) if r > OPTIMAL_RATIO), key=lambda i: -ratios[i])[:5]
    return {
        "instances": num_instances,
        "seed": seed,
        # null: OP-Fence raised PlanError although the exhaustive search found a plan that fits.
        "ratios": [_finite(r) for r in ratios],
        "median": _finite(float(np.median(ratios))),
        "p90": _finite(float(np.quantile(ratios, 0.9))),
        "worst": _finite(float(max(ratios))),
        "num_optimal": sum(r <= OPTIMAL_RATIO for r in ratios),
        "num_no_plan": sum(math.isinf(r) for r in ratios),
        "worst_instances": worst_misses,
        "opfence_s_median": float(np.median(opfence_s)),
        "targets": {"median": TARGET_MEDIAN_RATIO, "worst": TARGET_WORST_RATIO},
    }


def _finite(x: float) -> float | None:
    """JSON has no infinity: a missing plan is null."""
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------- part b
def capture_gpt2(preset: str, micro_batch_size: int, seq_len: int) -> Any:
    """GPT-2 ``preset`` captured on the meta device (no weights allocated), as an OpDag."""
    import torch

    from fusion.graph.export import capture
    from fusion.models import build_model
    from fusion.models.gpt2 import PRESETS

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model("gpt2", preset)
    x = torch.randint(0, PRESETS[preset]["vocab_size"], (micro_batch_size, seq_len)).to("meta")  # (B, T)
    return capture(model, (x,)).dag


def _fits(plan: Any, topology: Topology) -> bool:
    caps = {w.name: w.memory_bytes for w in topology.workers}
    return all(caps[s.worker] is None or (s.peak_memory_bytes or 0) <= caps[s.worker] for s in plan.stages)


def shipped_topologies(
    *,
    skip_xl: bool = False,
    jobs: tuple[tuple[str, str, int, int], ...] | None = None,
    topology_dir: Path = TOPOLOGY_DIR,
) -> dict[str, Any]:
    """Predicted step time of every strategy for each job (default :data:`JOBS`) on each shipped topology."""
    from scheduler.planner import PlanRequest, make_plan

    jobs = JOBS if jobs is None else jobs
    rows: list[dict[str, Any]] = []
    paths = sorted(topology_dir.glob("*.toml"))
    for label, preset, mb, seq_len in jobs:
        if skip_xl and preset == "xl":
            continue
        dag = capture_gpt2(preset, mb, seq_len)
        for path in paths:
            topology = Topology.load(path)
            row: dict[str, Any] = {
                "model": label,
                "topology": path.stem,
                "step_s": {},
                "stages": {},
                "fits_memory": {},
                "errors": {},
            }
            for strategy in STRATEGIES:
                try:
                    plan = make_plan(dag, topology, PlanRequest(strategy=strategy, micro_batches=MICRO_BATCHES))
                except PlanError as e:
                    row["step_s"][strategy] = None
                    row["stages"][strategy] = None
                    row["fits_memory"][strategy] = None
                    row["errors"][strategy] = str(e)
                    continue
                row["step_s"][strategy] = plan.predicted_step_s
                row["stages"][strategy] = len(plan.stages)
                row["fits_memory"][strategy] = _fits(plan, topology)
            ours = row["step_s"]["opfence"]
            row["speedup"] = {
                b: (row["step_s"][b] / ours if ours and row["step_s"][b] is not None else None)
                for b in ("uniform", "compute")
            }
            rows.append(row)
    return {
        "micro_batches": MICRO_BATCHES,
        "schedule": "1f1b",
        "optimizer": "adamw",
        "jobs": [list(j) for j in jobs],
        "rows": rows,
    }


# ---------------------------------------------------------------- part c
def synthetic_topology(num_workers: int, seed: int = 0) -> tuple[Topology, int]:
    """A clustered topology of ``num_workers`` (about 16 per cluster) and its cluster count.

    20/60/120 TFLOP/s and 16/24/40/80 GiB per worker; 1 or 10 Gbps (0.1 ms) inside a
    cluster; 8 Mbps, 100 Mbps or 1 Gbps (30 ms) between clusters.
    """
    rng = np.random.default_rng(seed)
    k = max(2, num_workers // 16)
    cluster_of = rng.integers(0, k, num_workers)
    topology = clustered_topology(
        cluster_of,
        flops=rng.choice([20e12, 60e12, 120e12], num_workers),
        memory_bytes=[int(g) * GIB for g in rng.choice([16, 24, 40, 80], num_workers)],
        intra_bytes_per_s=rng.choice([10 * GBPS, 1 * GBPS], k),
        inter_bytes_per_s=_symmetric_choice(rng, [8 * MBPS, 100 * MBPS, 1 * GBPS], k),
        intra_latency_s=1e-4,
        inter_latency_s=0.03,
    )
    return topology, len(np.unique(cluster_of))


def planning_time(
    sizes: tuple[int, ...] = PLANNING_SIZES, *, seed: int = 0, job: tuple[str, str, int, int] = PLANNING_JOB
) -> dict[str, Any]:
    """Wall time of OP-Fence planning ``job`` (GPT-2 XL) on synthetic topologies of each size."""
    from scheduler.planner import PlanRequest, make_plan

    label, preset, mb, seq_len = job
    dag = capture_gpt2(preset, mb, seq_len)
    out = []
    for n in sizes:
        t0 = time.perf_counter()
        topology, planted = synthetic_topology(n, seed)
        topology_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = make_plan(dag, topology, PlanRequest(strategy="opfence", micro_batches=MICRO_BATCHES))
        planning_s = time.perf_counter() - t0
        out.append(
            {
                "workers": n,
                "topology_s": topology_s,
                "planning_s": planning_s,
                "target_s": TARGET_PLANNING_S.get(n),
                "predicted_step_s": plan.predicted_step_s,
                "stages": len(plan.stages),
                "clusters_planted": planted,
                "clusters_found": len(plan.extra.get("clusters", [])),
                "evaluations": plan.extra.get("evaluations"),
                "fits_memory": _fits(plan, topology),
            }
        )
    return {"model": label, "micro_batches": MICRO_BATCHES, "rows": out}


# ---------------------------------------------------------------- report
def run(
    *,
    instances: int = 50,
    seed: int = 0,
    skip_xl: bool = False,
    jobs: tuple[tuple[str, str, int, int], ...] | None = None,
    planning_job: tuple[str, str, int, int] = PLANNING_JOB,
    planning_sizes: tuple[int, ...] = PLANNING_SIZES,
) -> dict[str, Any]:
    """All three parts, as one JSON-able document (``planning_time`` is null with ``skip_xl``)."""
    return {
        "optimality": optimality(instances, seed),
        "topologies": shipped_topologies(skip_xl=skip_xl, jobs=jobs),
        "planning_time": None if skip_xl else planning_time(planning_sizes, seed=seed, job=planning_job),
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(x: float | None) -> str:
    return "no plan" if x is None else f"{x:.4f}"


def _meets(x: float | None, target: float) -> bool:
    return x is not None and x <= target


def _ok(good: bool) -> str:
    return "ok" if good else "MISSED"


def format_report(doc: dict[str, Any]) -> str:
    """The document as the tables the command prints."""
    a = doc["optimality"]
    lines = [
        f"a. OP-Fence / exhaustive optimum, {a['instances']} random small instances (seed {a['seed']})",
        (
            f"   median {_ratio(a['median'])}  "
            f"(target <= {a['targets']['median']}: {_ok(_meets(a['median'], a['targets']['median']))})"
        ),
        f"   p90    {_ratio(a['p90'])}",
        (
            f"   worst  {_ratio(a['worst'])}  "
            f"(target <= {a['targets']['worst']}: {_ok(_meets(a['worst'], a['targets']['worst']))})"
        ),
        f"   optimal on {a['num_optimal']}/{a['instances']}, no plan found on {a['num_no_plan']} "
        f"(instances {a['worst_instances']} are the worst, 0-based); "
        f"OP-Fence median planning time {a['opfence_s_median'] * 1e3:.1f} ms",
        "",
        f"b. predicted step time (s), {doc['topologies']['micro_batches']} micro-batches, 1F1B, AdamW "
        "(* exceeds a worker's memory, - no plan fits)",
        (
            f"   {'model':<11} {'topology':<17} {'opfence':>9} {'uniform':>9} {'compute':>9} "
            f"{'x uniform':>9} {'x compute':>9} {'stages o/u/c':>12}"
        ),
    ]
    for r in doc["topologies"]["rows"]:
        cells = []
        for strategy in STRATEGIES:
            mark = "*" if r["fits_memory"][strategy] is False else ""
            cells.append(f"{_s(r['step_s'][strategy]) + mark:>9}")
        speed = [
            f"{v:>8.2f}x" if v is not None else f"{'-':>9}" for v in (r["speedup"]["uniform"], r["speedup"]["compute"])
        ]
        stages = "/".join("-" if r["stages"][s] is None else str(r["stages"][s]) for s in STRATEGIES)
        lines.append(f"   {r['model']:<11} {r['topology']:<17} {' '.join(cells)} {' '.join(speed)} {stages:>12}")
    for r in doc["topologies"]["rows"]:
        for strategy, err in r["errors"].items():
            lines.append(f"   {r['model']} on {r['topology']}, {strategy}: {err}")
    if doc["planning_time"] is not None:
        lines += [
            "",
            f"c. OP-Fence planning time, {doc['planning_time']['model']} on synthetic clustered topologies "
            "(* exceeds a worker's memory)",
            (
                f"   {'workers':>7} {'topology s':>10} {'plan s':>8} {'target':>8} {'step s':>8} {'stages':>6} "
                f"{'clusters found/planted':>22} {'evals':>6}"
            ),
        ]
        for r in doc["planning_time"]["rows"]:
            target = r["target_s"]
            verdict = "" if target is None else f"<={target:g} {_ok(r['planning_s'] <= target)}"
            lines.append(
                f"   {r['workers']:>7} {r['topology_s']:>10.2f} {r['planning_s']:>8.2f} {verdict:>8} "
                f"{r['predicted_step_s']:>8.3f}{'' if r['fits_memory'] else '*'} {r['stages']:>6} "
                f"{str(r['clusters_found']) + '/' + str(r['clusters_planted']):>22} {r['evaluations']!s:>6}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.bench.scheduler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=50, help="random small instances for part a (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random instances and synthetic topologies")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--skip-xl", action="store_true", help="leave GPT-2 XL out of part b and skip part c")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.instances < 1:
        parser.error("--instances must be >= 1")
    doc = run(instances=args.instances, seed=args.seed, skip_xl=args.skip_xl)
    print(json.dumps(doc, indent=2) if args.json else format_report(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
