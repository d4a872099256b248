"""The JSON documents of the live view: jobs, one job's progress and plan, workers, links.

Read-only views of a :class:`~fusion.coordinator.service.CoordinatorService`: its
:class:`~fusion.coordinator.store.Store` (jobs, workers, each job's log) and its measured
link table. Nothing here writes. Names and labels that workers report about themselves
travel as plain strings; the page renders them as text, never as markup.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion.coordinator.service import CoordinatorService

logger = logging.getLogger(__name__)

#: Most metric records one job document carries; the page asks again from ``last_seq``.
MAX_POINTS_PER_DOCUMENT = 5000
#: Most events one job document carries (the newest).
MAX_EVENTS_PER_DOCUMENT = 500
LIVE_WORKER_STATES = ("idle", "busy")


def jobs_document(service: CoordinatorService) -> list[dict[str, Any]]:
    """``GET /api/jobs``: every job, newest first, as ``{"id", "name", "state", "step",
    "steps", "loss", "samples_per_s", "waiting"}`` (``waiting``: what a pending job waits
    for, ``None`` when the coordinator does not say)."""
    out = []
    for job in reversed(service.store.jobs()):
        doc = service.status(job, events=False)
        out.append(
            {
                "id": doc["id"],
                "name": doc.get("name"),
                "state": doc["state"],
                "step": doc["step"],
                "steps": doc["steps"],
                "loss": doc["loss"],
                "samples_per_s": doc.get("samples_per_s"),
                "waiting": doc.get("waiting"),
            }
        )
    return out


def job_document(service: CoordinatorService, job_id: str, *, after_seq: int = 0) -> dict[str, Any]:
    """``GET /api/jobs/ID``: the job's ``fusion status --json`` document with its full plan
    (``plan``), its loss and throughput per step (``points``), its events (``events``, each
    with ``at_step``: the step it is marked at on the loss curve, ``None`` when the records
    after ``after_seq`` do not say), the newest step's link and compression figures
    (``last_metric``) and ``last_seq``, the log position to ask for next (``?after=``).

    ``NotFoundError`` for an unknown job id.
    """
    job = service.store.job(job_id)
    doc = service.status(job, events=False)
    doc["plan"] = plan_document(job.plan_json)
    records = service.store.log_records(job_id, after_seq=after_seq)
    points: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    last_metric: dict[str, Any] | None = None
    last_step: int | None = None
    last_seq = after_seq
    for seq, ts, kind, rec in records:
        if len(points) >= MAX_POINTS_PER_DOCUMENT:
            break
        last_seq = seq
        if kind == "metric":
            last_metric = rec
            last_step = int(rec.get("step", 0))
            points.append(_point(seq, ts, rec))
        elif kind == "event":
            marked = rec.get("failed_step", rec.get("step"))
            at_step = int(marked) if isinstance(marked, int | float) else last_step
            events.append({"seq": seq, "time": ts, "at_step": at_step, **rec})
    doc["points"] = points
    doc["events"] = events[-MAX_EVENTS_PER_DOCUMENT:]
    doc["last_metric"] = last_metric
    doc["last_seq"] = last_seq
    return doc


def _point(seq: int, ts: float, rec: dict[str, Any]) -> dict[str, Any]:
    point = {
        "seq": seq,
        "time": ts,
        "step": rec.get("step"),
        "loss": rec.get("loss"),
        "step_s": rec.get("step_s"),
        "samples_per_s": rec.get("samples_per_s"),
    }
    if "tokens_per_s" in rec:
        point["tokens_per_s"] = rec["tokens_per_s"]
    return point


def plan_document(plan_json: str | None) -> dict[str, Any] | None:
    """A stored plan without its node lists: ``{"strategy", "predicted_step_s",
    "micro_batches", "schedule", "stages": [{"worker", "nodes" (a count), "compute_s",
    "peak_memory_bytes", "param_bytes"}], "cuts": [{"src_stage", "dst_stage", "src_worker",
    "dst_worker", "bytes", "codec", "keep_ratio"}]}``; ``None`` before the job is planned."""
    if not plan_json:
        return None
    plan = json.loads(plan_json)
    stages = [
        {
            "worker": s.get("worker"),
            "nodes": len(s.get("nodes", ())),
            "compute_s": s.get("compute_s"),
            "peak_memory_bytes": s.get("peak_memory_bytes"),
            "param_bytes": s.get("param_bytes"),
        }
        for s in plan.get("stages", ())
    ]

    def worker_of(idx: Any) -> str | None:
        return stages[idx]["worker"] if isinstance(idx, int) and 0 <= idx < len(stages) else None

    cuts = [
        {
            "src_stage": c.get("src_stage"),
            "dst_stage": c.get("dst_stage"),
            "src_worker": worker_of(c.get("src_stage")),
            "dst_worker": worker_of(c.get("dst_stage")),
            "bytes": c.get("bytes"),
            "codec": c.get("codec", "none"),
            "keep_ratio": c.get("keep_ratio", 1.0),
        }
        for c in plan.get("cuts", ())
    ]
    return {
        "strategy": plan.get("strategy"),
        "predicted_step_s": plan.get("predicted_step_s"),
        "micro_batches": plan.get("micro_batches"),
        "schedule": plan.get("schedule"),
        "stages": stages,
        "cuts": cuts,
    }


def workers_document(service: CoordinatorService) -> list[dict[str, Any]]:
    """``GET /api/workers``: every registered worker, live ones first, as ``{"id", "name",
    "address", "state", "job_id", "device", "device_name", "matmul_flops", "memory_bytes"
    (what it lends), "device_memory_bytes", "num_cores", "last_heartbeat_age_s"}``."""
    now = time.time()
    rows = service.store.workers()
    rows.sort(key=lambda w: (w.state not in LIVE_WORKER_STATES, -w.registered_at))
    out = []
    for w in rows:
        r = w.resources
        out.append(
            {
                "id": w.worker_id,
                "name": w.name,
                "address": w.address,
                "state": w.state,
                "job_id": w.job_id,
                "device": r.get("device", ""),
                "device_name": r.get("device_name", ""),
                "matmul_flops": _number(r.get("matmul_flops")),
                "memory_bytes": _number(r.get("memory_bytes")),
                "device_memory_bytes": _number(r.get("device_memory_bytes")),
                "num_cores": _number(r.get("num_cores")),
                "last_heartbeat_age_s": round(now - w.last_heartbeat, 3),
            }
        )
    return out


def links_document(service: CoordinatorService) -> list[dict[str, Any]]:
    """``GET /api/links``: the measured links between live workers, ``{"src", "dst",
    "latency_s", "bandwidth_bytes_per_s"}`` with ``src``/``dst`` the workers' names."""
    names: dict[str, str] = {}
    for w in service.store.workers():  # oldest first: the newest registration wins
        if w.state in LIVE_WORKER_STATES:
            names[w.address] = w.name
    out = []
    for pair, fit in sorted(service.links.snapshot().items()):
        src, _, dst = pair.partition("->")
        if src not in names or dst not in names:
            continue
        out.append(
            {
                "src": names[src],
                "dst": names[dst],
                "latency_s": fit["latency_s"],
                "bandwidth_bytes_per_s": fit["bandwidth_bytes_per_s"],
            }
        )
    return out


def _number(value: Any) -> float:
    """A resources field as a number (protobuf's JSON writes 64-bit integers as strings)."""
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0
