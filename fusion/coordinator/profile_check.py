"""``fusion profile [--check]``: measure a job on live workers, and hold the estimator to its predictions.

For a job and a set of live workers: measure (profile the model, probe the links), and with
``check`` plan with several strategies and worker counts, run each plan for a few steps
through the executor, and compare the predicted step time and per-worker peak memory with
what the runs measured. The result is a table per plan and the mean absolute percentage
error (MAPE) over all of them.

This runs **inside the coordinator** (``ProfileWorkers`` RPC, :func:`profile_report`):
every executor call must prove the worker's control key, which only the worker and the
coordinator can derive (SECURITY.md). The job owner's CLI gets a JSON document back and
prints it (:func:`format_report`).
"""

from __future__ import annotations

import logging
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from executor.client import ChannelPool
from executor.driver import PipelineDriver
from fusion.config import JobSpec
from fusion.coordinator.planning import Endpoint, Measurements, measure, plan_job
from fusion.graph.split import split_stages
from fusion.training import (
    build_job_dataset,
    build_job_model,
    capture_job_model,
    example_micro_batch,
    job_batch,
)
from scheduler.plan import Plan
from scheduler.topology import Topology

logger = logging.getLogger(__name__)


@dataclass
class CheckRow:
    """Predicted against measured for one plan."""

    label: str
    stages: int
    predicted_step_s: float
    measured_step_s: float
    predicted_memory: list[int] = field(default_factory=list)
    measured_memory: list[int] = field(default_factory=list)

    @property
    def time_error(self) -> float:
        return abs(self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    def memory_errors(self) -> list[float]:
        return [abs(p - m) / m for p, m in zip(self.predicted_memory, self.measured_memory, strict=False) if m > 0]

    def memory_under(self) -> float:
        """Worst under-prediction of memory as a fraction (0 if never under)."""
        return max(
            (max(0.0, (m - p) / m) for p, m in zip(self.predicted_memory, self.measured_memory, strict=False) if m > 0),
            default=0.0,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckRow:
        """Inverse of :meth:`to_dict` (for the CLI, which receives rows as JSON)."""
        return cls(
            label=str(d["plan"]),
            stages=int(d["stages"]),
            predicted_step_s=float(d["predicted_step_s"]),
            measured_step_s=float(d["measured_step_s"]),
            predicted_memory=[int(b) for b in d["predicted_memory_bytes"]],
            measured_memory=[int(b) for b in d["measured_memory_bytes"]],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.label,
            "stages": self.stages,
            "predicted_step_s": self.predicted_step_s,
            "measured_step_s": self.measured_step_s,
            "time_error": self.time_error,
            "predicted_memory_bytes": self.predicted_memory,
            "measured_memory_bytes": self.measured_memory,
            "memory_errors": self.memory_errors(),
        }


def run_plan(
    spec: JobSpec,
    model: Any,
    captured: Any,
    dataset: Any,
    plan: Plan,
    workers: dict[str, str],
    pool: ChannelPool,
    *,
    steps: int,
    device: str,
    topology: Topology | None = None,
) -> tuple[float, list[int]]:
    """Run ``plan`` for ``steps`` timed steps after a warm-up step, then one more step that
    counts memory (its hooks would slow the timed steps); median step seconds and the peak
    memory per stage. With the measured ``topology`` the stages pace their sends at its
    links' bandwidth, as in a job."""
    stages = split_stages(captured.dag, plan.assignment())
    _, example_y = example_micro_batch(spec, dataset)
    links: dict[tuple[int, int], float] = {}
    if topology is not None:
        idx = [topology.names().index(s.worker) for s in plan.stages]
        links = {
            (a, b): topology.bandwidth_bytes_per_s[idx[a]][idx[b]]
            for a in range(len(idx))
            for b in range(len(idx))
            if idx[a] != idx[b]
        }
    driver = PipelineDriver(
        job_id=f"check-{uuid.uuid4().hex[:8]}",
        job=spec,
        model=model,
        captured=captured,
        stages=stages,
        addresses=[workers[s.worker] for s in plan.stages],
        example_target=example_y,
        device=device,
        pool=pool,
        link_bytes_per_s=links,
        leaf_modules=spec.model.leaf_modules,
    )
    times: list[float] = []
    peaks = [0] * len(stages)
    try:
        driver.load()
        for step in range(steps + 2):
            x, y = job_batch(spec, dataset, step)
            memory_step = step == steps + 1
            stats = driver.train_step(step, (x,), y, measure_memory=memory_step)
            if memory_step:
                for s, peak in stats.peak_memory_bytes.items():
                    peaks[s] = max(peaks[s], peak)
            elif step > 0:  # step 0 warms up: first-touch allocations, channel set-up
                times.append(stats.step_s)
    finally:
        driver.close()
    return statistics.median(times), peaks


def check_estimator(
    spec: JobSpec,
    endpoints: Sequence[Endpoint],
    *,
    pool: ChannelPool,
    steps: int = 5,
    device: str = "cpu",
    strategies: Sequence[str] = ("uniform", "compute", "opfence"),
    progress: Any = None,
) -> tuple[list[CheckRow], Measurements]:
    """Plan with each strategy (and ``uniform`` on every worker count), run, compare."""
    model = build_job_model(spec)
    dataset = build_job_dataset(spec)
    example_x, _ = example_micro_batch(spec, dataset)
    captured = capture_job_model(spec, model, example_x)
    m = measure(spec, model, captured, dataset, endpoints, pool, device=device)
    by_name = {e.name: e.address for e in endpoints}
    configs: list[tuple[str, Measurements]] = []
    for k in range(1, len(endpoints) + 1):
        configs.append((f"uniform/{k}", m.subset(range(k))))
    for strategy in strategies:
        if strategy != "uniform":
            configs.append((strategy, m))
    rows = []
    for label, meas in configs:
        plan = plan_job(spec, meas, strategy=label.split("/")[0])
        measured_s, measured_mem = run_plan(
            spec, model, captured, dataset, plan, by_name, pool, steps=steps, device=device, topology=meas.topology
        )
        row = CheckRow(
            label=label,
            stages=len(plan.stages),
            predicted_step_s=float(plan.predicted_step_s or 0.0),
            measured_step_s=measured_s,
            predicted_memory=[int(s.peak_memory_bytes or 0) for s in plan.stages],
            measured_memory=measured_mem,
        )
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows, m


def summarize(rows: Sequence[CheckRow]) -> dict[str, float]:
    """MAPE of step time and memory, and the worst memory under-prediction."""
    mem = [e for r in rows for e in r.memory_errors()]
    return {
        "time_mape": statistics.mean(r.time_error for r in rows) if rows else 0.0,
        "memory_mape": statistics.mean(mem) if mem else 0.0,
        "memory_worst_under": max((r.memory_under() for r in rows), default=0.0),
    }


def format_rows(rows: Sequence[CheckRow]) -> str:
    lines = [f"{'plan':<12} {'stages':>6} {'pred s':>9} {'meas s':>9} {'err':>6}  {'pred MB':>18} {'meas MB':>18}"]
    for r in rows:
        pm = "/".join(f"{b / 1e6:.1f}" for b in r.predicted_memory)
        mm = "/".join(f"{b / 1e6:.1f}" for b in r.measured_memory)
        lines.append(
            f"{r.label:<12} {r.stages:>6} {r.predicted_step_s:>9.4f} {r.measured_step_s:>9.4f} "
            f"{100 * r.time_error:>5.1f}%  {pm:>18} {mm:>18}"
        )
    s = summarize(rows)
    lines.append(
        f"time MAPE {100 * s['time_mape']:.1f}%  memory MAPE {100 * s['memory_mape']:.1f}%  "
        f"worst memory under-prediction {100 * s['memory_worst_under']:.1f}%"
    )
    return "\n".join(lines)


def measurement_report(spec: JobSpec, m: Measurements, endpoints: Sequence[Endpoint], num_nodes: int) -> dict[str, Any]:
    """What ``fusion profile`` (without ``--check``) shows, as JSON-able data."""
    graph = m.profile.nodes.get("__graph__", {})
    top = sorted(
        ((v["fwd_time_s"] + v["bwd_time_s"], k) for k, v in m.profile.nodes.items() if not k.startswith("__")),
        reverse=True,
    )[:8]
    names = m.topology.names()
    return {
        "model": spec.model.name,
        "preset": spec.model.preset,
        "num_nodes": num_nodes,
        "profiled_on": endpoints[0].name,
        "device_name": m.profile.device_name,
        "fwd_time_s": graph.get("fwd_time_s", 0.0),
        "bwd_time_s": graph.get("bwd_time_s", 0.0),
        "matmul_flops": m.profile.matmul_flops,
        "overhead_step_s": m.overhead.step_s,
        "overhead_micro_batch_s": m.overhead.micro_batch_s,
        "slowest_nodes": [{"node": name, "time_s": t} for t, name in top],
        "links": [
            {
                "src": a,
                "dst": b,
                "latency_s": m.topology.latency_s[i][j],
                "bandwidth_bytes_per_s": m.topology.bandwidth_bytes_per_s[i][j],
            }
            for i, a in enumerate(names)
            for j, b in enumerate(names)
            if i != j
        ],
    }


def profile_report(
    spec: JobSpec,
    endpoints: Sequence[Endpoint],
    *,
    pool: ChannelPool,
    check: bool,
    steps: int = 5,
    device: str = "cpu",
) -> dict[str, Any]:
    """Measure ``spec`` on ``endpoints`` (and with ``check`` run plans); the ``fusion profile --json`` document.

    ``pool`` must sign calls with the workers' control keys (the coordinator's pool does).
    """
    if check:
        rows, _ = check_estimator(
            spec,
            endpoints,
            pool=pool,
            steps=steps,
            device=device,
            progress=lambda r: logger.info(
                "profile check ran %s: predicted %.4fs, measured %.4fs", r.label, r.predicted_step_s, r.measured_step_s
            ),
        )
        return {"plans": [r.to_dict() for r in rows], **summarize(rows)}
    model = build_job_model(spec)
    dataset = build_job_dataset(spec)
    x, _ = example_micro_batch(spec, dataset)
    captured = capture_job_model(spec, model, x)
    m = measure(spec, model, captured, dataset, endpoints, pool, device=device)
    return measurement_report(spec, m, endpoints, len(captured.dag.compute_nodes()))


def format_report(doc: dict[str, Any]) -> str:
    """The human-readable ``fusion profile`` output for a :func:`profile_report` document."""
    if "plans" in doc:
        return format_rows([CheckRow.from_dict(r) for r in doc["plans"]])
    lines = [
        (
            f"model {doc['model']} ({doc['preset']}): {doc['num_nodes']} nodes, "
            f"profiled on {doc['profiled_on']} ({doc['device_name']})"
        ),
        (
            f"  forward {doc['fwd_time_s'] * 1e3:.2f} ms, backward {doc['bwd_time_s'] * 1e3:.2f} ms per micro-batch; "
            f"matmul {doc['matmul_flops'] / 1e9:.1f} GFLOP/s"
        ),
        (
            f"  executor overhead: {doc['overhead_step_s'] * 1e3:.2f} ms per step, "
            f"{doc['overhead_micro_batch_s'] * 1e3:.2f} ms per micro-batch"
        ),
    ]
    lines += [f"    {n['node']:<40} {n['time_s'] * 1e3:8.3f} ms" for n in doc["slowest_nodes"]]
    lines += [
        f"  link {link['src']} -> {link['dst']}: {link['latency_s'] * 1e3:.2f} ms "
        f"+ bytes / {link['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s"
        for link in doc["links"]
    ]
    return "\n".join(lines)
