"""The at-scale simulator: predicted step time of fusion and the baselines on any topology
(the command is :mod:`testbeds.sim.cli`, ``python -m testbeds.simulate``).

Nothing is trained. Per-node costs come from profiling the job's model on this machine
(:func:`fusion.profiling.profile_graph`, ``--costs profile``, the default) or from FLOPs
(``--costs flops``); they are replayed through the same workload estimator the coordinator
plans with (:mod:`scheduler.estimator`), on topologies one host cannot run. The systems:

- ``fusion``: OP-Fence's plan (:func:`scheduler.planner.make_plan`) with AdaTopK, priced by the
  estimator with the cuts it marks as slow carrying top-k tensors at the ratio AdaTopK
  (:class:`compress.controller.AdaTopK`) would pick for the link, and encoded at
  :func:`compress.topk.topk_encoded_size` bytes (zstd's further gain is not counted).
- ``uniform``: equal node counts in join order, dense, priced the same way.
- ``ddp``: data parallel over every host, ``B / N`` samples per rank, gradients summed
  bucket by bucket as each rank's backward makes them ready, gloo's ring replayed message
  by message and step after step, each forward after the broadcast of the module's
  buffers (:func:`testbeds.sim.gloo.ddp_replay_step_s`; the closed form
  :func:`testbeds.sim.gloo.ring_allreduce_s` after the backward where the replay would
  be too long).
- ``pipelining``: GPipe over ``S = min(N, blocks)`` hosts with the even block split of
  :mod:`testbeds.sim.block_split` (:func:`testbeds.sim.gloo.gpipe_step_s`), each
  transfer a round trip plus its bytes (gloo sends only to a posted receive).

``--compute testbed`` prices every host at this machine's measured speed, as a testbed on
one host runs them without emulated speeds (``--validate`` prices each run's emulated hosts
as it ran them); ``--compute topology`` (default) uses
each host's ``flops`` from the file. ``paper-256`` and ``paper-1024`` name generated
topologies (:func:`testbeds.sim.topologies.paper_topology`) shaped like ``topologies/paper-48.toml``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusion.config import JobSpec
from fusion.errors import FusionError, PlanError
from scheduler.estimator import (
    estimate,
)
from scheduler.planner import compression_marks, make_plan, price, request_for_job
from scheduler.topology import Topology
from testbeds.sim.baselines import simulate_ddp, simulate_pipelining
from testbeds.sim.costs import (
    SYSTEMS,
    JobCosts,
    SystemResult,
    slowest_link,
    with_throughput,
)
from testbeds.sim.machine import TransferInterference
from testbeds.sim.replay import replay_step

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- systems
def simulate_plan(
    job: JobCosts,
    topology: Topology,
    *,
    strategy: str,
    compression: str,
    time_budget_s: float | None = None,
    driver: int | None = 0,
    given: list[dict[str, Any]] | None = None,
    cores: int | None = None,
    pause_cost: Callable[[float, bool], float] | None = None,
    transfer_cost: Callable[[float, float], float] | None = None,
    interference: TransferInterference | None = None,
    driver_links: Sequence[tuple[float, float]] | None = None,
    emulation: str = "wall",
) -> SystemResult:
    """fusion (``opfence`` + the job's compression) or ``uniform`` (dense), priced by the
    estimator with the driver (the coordinator) on host ``driver``: its control round trips
    and feed cross that host's links (``None``: the driver's path is free).
    ``driver_links``: the driver's ``(round_trip_s, bandwidth_bytes_per_s)`` to each host as
    a run's coordinator measured them, in place of the configured links from ``driver``
    (whose own host would be free: a gRPC round trip inside one host is not).

    ``given``: price this plan (``[{"worker", "nodes"}]``, as a bench run recorded it)
    instead of planning. The step is the event replay of the executor running the plan
    (:mod:`testbeds.sim.replay`); the estimator's closed form, which planned it, is kept in
    ``detail``. Hosts that share a machine (:func:`testbed_topology`) share its ``cores``
    (``None``: one at a time, as the estimator assumes); ``pause_cost`` and
    ``transfer_cost``: what a stage's computation and a transfer's path through the
    executors cost after a pause on such a machine (:mod:`testbeds.sim.machine`);
    ``interference``: what a transfer costs the computation it overlaps in its process
    (:mod:`testbeds.sim.machine`).
    """
    from fusion.graph.split import split_stages

    spec = job.spec
    free_driver = topology.with_driver_links(None)
    if driver_links is not None:
        if len(driver_links) != len(topology):
            raise FusionError(f"{len(driver_links)} driver links for {len(topology)} hosts")
        topology = topology.with_driver_links(driver_links)
    else:
        topology = free_driver if driver is None else topology.with_driver_at(driver)
    request = request_for_job(spec, strategy=strategy, step_costs=job.step)
    request = dataclasses.replace(request, compression=compression, time_budget_s=time_budget_s)
    name = "fusion" if strategy == "opfence" else strategy
    if given:
        assignment = {n: i for i, s in enumerate(given) for n in s["nodes"]}
        stage_workers = [topology.index(s["worker"]) for s in given]
        predicted = None
    else:
        try:
            plan = make_plan(job.dag, topology, request)
        except PlanError as e:
            return SystemResult(name=name, step_s=None, note=f"n/a: {e}")
        assignment = plan.assignment()
        stage_workers = [topology.index(s.worker) for s in plan.stages]
        predicted = plan.predicted_step_s
    stages = split_stages(job.dag, assignment)
    est = price(job.dag, stages, stage_workers, topology, request)
    marks = compression_marks(est, request)
    wl = job.workload()
    stage_of = {n: s.stage_idx for s in stages for n in s.nodes}
    unit_stage = np.array([stage_of[n] for n in wl.names], dtype=np.int64)
    act_factor, grad_factor, ratios = _compression_factors(est, marks, stage_workers, topology, request, spec)
    if act_factor or grad_factor:
        wl.edges = [
            (
                s,
                d,
                int(size * act_factor.get((int(unit_stage[s]), int(unit_stage[d])), 1.0)),
                int(gsize * grad_factor.get((int(unit_stage[s]), int(unit_stage[d])), 1.0)),
            )
            for s, d, size, gsize in wl.edges
        ]
        wl._edge_arrays = None
        est = estimate(
            wl, unit_stage, stage_workers, topology, micro_batches=request.micro_batches, schedule=request.schedule
        )
    m = request.micro_batches
    per_pair: dict[tuple[int, int], float] = {}
    for (a, c), size in est.link_bytes.items():
        wa, wc = stage_workers[a], stage_workers[c]
        per_pair[(wa, wc)] = per_pair.get((wa, wc), 0.0) + m * size * (
            1 + grad_factor.get((a, c), 1.0) / act_factor.get((a, c), 1.0)
        )
    slow_bytes, slow_mbps = slowest_link(topology, per_pair)
    control_path_s = (
        est.step_s
        - estimate(wl, unit_stage, stage_workers, free_driver, micro_batches=m, schedule=request.schedule).step_s
    )
    replay = replay_step(
        wl,
        unit_stage,
        stage_workers,
        topology,
        micro_batches=m,
        schedule=request.schedule,
        cores=cores or 1,
        pause_cost=pause_cost,
        transfer_cost=transfer_cost,
        interference=interference,
        emulation=emulation,
    )
    return with_throughput(
        SystemResult(
            name=name,
            step_s=replay.step_s,
            slowest_link_bytes=slow_bytes,
            slowest_link_mbps=slow_mbps,
            hosts_used=len(set(stage_workers)),
            detail={
                "stages": [topology.workers[w].name for w in stage_workers],
                "uncompressed_step_s": predicted,
                "keep_ratios": {
                    f"{topology.workers[stage_workers[a]].name}->{topology.workers[stage_workers[c]].name}": r
                    for (a, c), r in ratios.items()
                },
                "bottleneck_s": est.bottleneck_s,
                "estimator_step_s": est.step_s,
                "stage_compute_s": list(est.stage_compute_s),
                "replay_compute_s": list(replay.compute_s),
                "replay_finished_s": list(replay.finished_s),
                "replay_done_s": list(replay.stages_done_s),
                "replay_run_step_s": replay.run_step_s,
                "replay_fed_s": {str(k): v for k, v in replay.fed_s.items()},
                "driver_s": control_path_s,
            },
        ),
        job,
    )


def _compression_factors(
    est: Any, marks: dict, stage_workers: list[int], topology: Topology, request: Any, spec: JobSpec
) -> tuple[dict, dict, dict]:
    """Bytes after/before for each compressed cut and direction, at AdaTopK's ratio (or top-k's)."""
    from compress.controller import AdaTopK
    from compress.topk import num_kept, topk_encoded_size

    act: dict[tuple[int, int], float] = {}
    grad: dict[tuple[int, int], float] = {}
    ratios: dict[tuple[int, int], float] = {}
    target = max(est.stage_compute_s) if est.stage_compute_s else 0.0
    for (a, c), (_, start_ratio, *_) in marks.items():
        dense = est.link_bytes[(a, c)]
        numel = max(1, dense // 4)  # fp32 activations
        wa, wc = stage_workers[a], stage_workers[c]
        factors = {}
        for direction, (i, j) in (("activations", (wa, wc)), ("gradients", (wc, wa))):
            if direction not in spec.compression.directions:
                factors[direction] = 1.0
                continue
            if request.compression == "topk":
                ratio = start_ratio
            else:
                ratio = AdaTopK(min_keep_ratio=request.min_keep_ratio).ratio(
                    (a, c, direction),
                    numel=numel,
                    dense_bytes=dense,
                    bandwidth_bytes_per_s=topology.bandwidth_bytes_per_s[i][j],
                    latency_s=topology.latency_s[i][j],
                    target_s=max(target, 1e-6),
                )
            factors[direction] = 1.0 if ratio >= 1.0 else topk_encoded_size(numel, num_kept(numel, ratio)) / dense
            if direction == "activations":
                ratios[(a, c)] = ratio
        act[(a, c)], grad[(a, c)] = factors["activations"], factors["gradients"]
    return act, grad, ratios


def simulate(
    job: JobCosts,
    topology: Topology,
    systems: tuple[str, ...] = SYSTEMS,
    *,
    time_budget_s: float | None = None,
    driver: int | None = None,
    cores: int | None = None,
    emulation: str = "wall",
) -> dict[str, Any]:
    """Every requested system on one topology, with fusion's speed-up over each baseline.

    ``driver``: host index of fusion's coordinator (``None``: ignore its control path);
    ``cores``: cores all hosts share on a one-machine testbed, for the gloo baselines'
    ranks and for fusion's and uniform's stages where the topology puts hosts on one machine
    (``None``: hosts are machines); ``emulation``: how a testbed's emulated hosts stretch
    (:mod:`testbeds.emulation`).
    """
    results: dict[str, SystemResult] = {}
    timings: dict[str, float] = {}
    for name in systems:
        t0 = time.perf_counter()
        if name == "fusion":
            results[name] = simulate_plan(
                job,
                topology,
                strategy="opfence",
                compression="adatopk",
                time_budget_s=time_budget_s,
                driver=driver,
                cores=cores,
                emulation=emulation,
            )
        elif name == "uniform":
            results[name] = simulate_plan(
                job, topology, strategy="uniform", compression="none", driver=driver, cores=cores, emulation=emulation
            )
        elif name == "ddp":
            results[name] = simulate_ddp(job, topology, cores=cores, emulation=emulation)
        elif name == "pipelining":
            results[name] = simulate_pipelining(job, topology, cores=cores, emulation=emulation)
        else:
            raise FusionError(f"unknown system {name!r}; choose from {SYSTEMS}")
        timings[name] = time.perf_counter() - t0
    fusion = results.get("fusion")
    speedup = {}
    if fusion is not None and fusion.step_s:
        for name, r in results.items():
            if name != "fusion":
                speedup[name] = r.step_s / fusion.step_s if r.step_s else None
    return {
        "num_hosts": len(topology),
        "costs": job.costs,
        "systems": {name: r.to_dict() for name, r in results.items()},
        "speedup": speedup,
        "simulate_s": timings,
    }


# ---------------------------------------------------------------- output
def markdown_table(title: str, report: dict[str, Any]) -> str:
    """One topology's systems as a markdown table."""
    lines = [
        f"### {title}",
        "",
        "| system | step s | samples/s | tokens/s | hosts | slowest link | bytes/step on it | fusion x | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in report["systems"].items():
        step = f"{r['step_s']:.4g}" if r["step_s"] else "n/a"
        sps = f"{r['samples_per_s']:.4g}" if r["samples_per_s"] else "-"
        tps = f"{r['tokens_per_s']:.4g}" if r["tokens_per_s"] else "-"
        link = f"{r['slowest_link_mbps']:g} Mbps" if r["slowest_link_mbps"] else "none"
        sp = report["speedup"].get(name)
        lines.append(
            f"| {name} | {step} | {sps} | {tps} | {r['hosts_used']} | {link} | {r['slowest_link_bytes']:,} | "
            f"{f'{sp:.2f}' if sp else ('-' if name == 'fusion' else 'n/a')} | {r['note']} |"
        )
    return "\n".join(lines) + "\n"
