"""The end report of a chaos run: the figures a reader checks first, as text and JSON.

The document :func:`testbeds.chaos.run.run_chaos` returns is the JSON (``--json OUT``);
:func:`summarise` adds the derived figures (events by kind, injected or not; growth of the
coordinator's memory, threads and files) and :func:`report_lines` prints them.
"""

from __future__ import annotations

import logging
from typing import Any

from testbeds.chaos.leaks import growth_pct, restart_baseline
from testbeds.chaos.schedule import KINDS

logger = logging.getLogger(__name__)


def summarise(doc: dict[str, Any]) -> dict[str, Any]:
    """Add ``summary`` to ``doc`` (in place) and return it."""
    chaos = doc.get("chaos") or {}
    events = chaos.get("events") or []
    injected = {k: sum(1 for e in events if e["kind"] == k and e["injected"]) for k in KINDS}
    not_injected = {k: sum(1 for e in events if e["kind"] == k and not e["injected"]) for k in KINDS}
    before = chaos.get("before") or {}
    after = chaos.get("after") or {}
    cb, ca = before.get("coordinator") or {}, after.get("coordinator") or {}
    same_coordinator = bool(cb) and cb.get("pid") == ca.get("pid")
    summary = {
        "finished": chaos.get("finished"),
        "state": chaos.get("state"),
        "reason": chaos.get("reason"),
        "model_equal": (doc.get("model") or {}).get("equal"),
        "events_injected": sum(injected.values()),
        "events_not_injected": sum(not_injected.values()),
        "injected_by_kind": {k: v for k, v in injected.items() if v},
        "not_injected_by_kind": {k: v for k, v in not_injected.items() if v},
        "processes_before": before.get("num_processes"),
        "processes_after_job": after.get("num_processes"),
        "processes_after_stop": len(chaos.get("alive_after_stop") or []),
        "coordinator_same_process": same_coordinator,
        "coordinator_fds": [cb.get("num_fds"), ca.get("num_fds")],
        "coordinator_threads": [cb.get("num_threads"), ca.get("num_threads")],
        "coordinator_rss_growth_pct": growth_pct(cb.get("rss_bytes"), ca.get("rss_bytes"))
        if same_coordinator
        else None,
        **_since_restart(chaos, same_coordinator, ca),
        "liveness": chaos.get("liveness"),
        "leftovers_clean": (doc.get("leftovers") or {}).get("clean"),
    }
    doc["summary"] = summary
    return summary


def _since_restart(chaos: dict[str, Any], same_coordinator: bool, after: dict[str, Any]) -> dict[str, Any]:
    """After a coordinator restart: the figures from the last coordinator's first sample
    while the job ran (:func:`testbeds.chaos.leaks.restart_baseline`) to the end."""
    if same_coordinator:
        return {}
    samples = chaos.get("coordinator_samples")
    base = restart_baseline(samples, after.get("pid")) if samples else chaos.get("restart_baseline")
    if not base:
        return {}
    return {
        "restart_baseline_t_s": base.get("t_s"),
        "coordinator_rss_growth_since_restart_pct": growth_pct(base.get("rss_bytes"), after.get("rss_bytes")),
        "coordinator_fds_since_restart": [base.get("num_fds"), after.get("num_fds")],
        "coordinator_threads_since_restart": [base.get("num_threads"), after.get("num_threads")],
        "coordinator_rss_mib_since_restart": [
            round(v / 2**20, 1) if v else None for v in (base.get("rss_bytes"), after.get("rss_bytes"))
        ],
    }


def reaction_summary(reactions: list[dict[str, Any]]) -> str:
    """The job events after an injection in one line: runs of one event counted, state changes spelled out."""
    parts: list[list[Any]] = []
    for r in reactions:
        name = r["event"] if r["event"] != "state" else f"state ({str(r.get('message'))[:90]})"
        if parts and parts[-1][0] == name:
            parts[-1][1] += 1
        else:
            parts.append([name, 1])
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in parts) or "nothing"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def _restart_lines(live: dict[str, Any]) -> list[str]:
    """Each coordinator restart's downtime, and what the report means by it."""
    restarts = live.get("coordinator_restarts") or []
    if not restarts:
        return []
    lines = [f"    ({live.get('down_definition', 'downtime: from the kill to the first answer')})"]
    for r in restarts:
        lines.append(
            f"    restart #{r['idx']}: killed at {_fmt(r['killed_s'])}s, spawned at {_fmt(r['spawned_s'])}s, "
            f"listening {_fmt(r['listening_after_spawn_s'])} s and first answer "
            f"{_fmt(r['first_answer_after_spawn_s'])} s after spawn; down {_fmt(r['down_s'])} s"
        )
    for p in (live.get("failed_otherwise_polls") or [])[:10]:
        lines.append(f"    failed poll at {_fmt(p['t_s'])}s: {p.get('error')}")
    return lines


def report_lines(doc: dict[str, Any]) -> list[str]:
    """The end report a user reads."""
    s = doc.get("summary") or summarise(doc)
    chaos = doc.get("chaos") or {}
    model = doc.get("model") or {}
    live = s.get("liveness") or {}
    lines = [
        f"chaos report: {doc.get('topology')} ({doc.get('backend', '?')}), job {doc.get('job')}, "
        f"seed {doc.get('seed')}, "
        f"{doc.get('minutes')} min at {doc.get('events_per_minute')} events/min",
    ]
    if doc.get("error"):
        lines.append(f"  HARNESS ERROR: {doc['error']}")
    lines.append(
        f"  job {chaos.get('job_id', '-')}: {s['state']}"
        + (f" ({s['reason']})" if s.get("reason") else "")
        + f", step {_fmt(chaos.get('step'))}, loss {_fmt(chaos.get('loss'))}"
        + f", finished: {'yes' if s['finished'] else 'NO'}"
    )
    if model:
        detail = model.get("why", "")
        if model.get("max_abs_diff"):
            detail += f", max |diff| {model['max_abs_diff']:.3g}"
        if model.get("loss_diff_pct") is not None:
            detail += f", loss {model.get('loss')} vs {model.get('reference_loss')} ({model['loss_diff_pct']:.2f} %)"
        verdict = {True: "yes", False: "NO", None: "unknown"}[model.get("equal")]
        lines.append(f"  model equals the uninterrupted run's: {verdict} ({detail})")
    else:
        lines.append("  model equals the uninterrupted run's: not compared (no reference run)")
    lines.append(
        f"  events injected: {s['events_injected']} "
        + (", ".join(f"{k} {v}" for k, v in s["injected_by_kind"].items()) or "-")
    )
    if s["events_not_injected"]:
        lines.append(
            f"  events NOT injected: {s['events_not_injected']} "
            + ", ".join(f"{k} {v}" for k, v in s["not_injected_by_kind"].items())
        )
    lines.append(
        f"  fleet processes: {_fmt(s['processes_before'])} at training start, {_fmt(s['processes_after_job'])} "
        f"at the job's end, {s['processes_after_stop']} after stop"
    )
    fds, threads = s["coordinator_fds"], s["coordinator_threads"]
    same = "" if s["coordinator_same_process"] else " (coordinator restarted: growth not comparable)"
    lines.append(
        f"  coordinator: fds {_fmt(fds[0])} -> {_fmt(fds[1])}, threads {_fmt(threads[0])} -> {_fmt(threads[1])}, "
        f"RSS growth {_fmt(s['coordinator_rss_growth_pct'])} %{same}"
    )
    if s.get("coordinator_rss_growth_since_restart_pct") is not None:
        rss = s["coordinator_rss_mib_since_restart"]
        lines.append(
            f"  coordinator since its last restart (first sample with the job running, "
            f"{_fmt(s['restart_baseline_t_s'])}s): RSS {_fmt(rss[0])} -> {_fmt(rss[1])} MiB, growth "
            f"{_fmt(s['coordinator_rss_growth_since_restart_pct'])} %, fds "
            f"{_fmt(s['coordinator_fds_since_restart'][0])} -> {_fmt(s['coordinator_fds_since_restart'][1])}, "
            f"threads {_fmt(s['coordinator_threads_since_restart'][0])} -> "
            f"{_fmt(s['coordinator_threads_since_restart'][1])}"
        )
    lines.append(
        f"  fusion status: {live.get('polls', 0)} polls, {live.get('failed_otherwise', 0)} failed "
        f"(+{live.get('failed_while_coordinator_down', 0)} while a restarted coordinator was down), "
        f"max latency {_fmt(live.get('max_latency_s'))} s"
    )
    lines.extend(_restart_lines(live))
    for e in chaos.get("events") or []:
        seen = reaction_summary(e.get("reactions") or [])
        what = f"{e['kind']} {e.get('target') or ''}".strip()
        if e["injected"]:
            lines.append(f"    #{e['idx']} {e['started_s']:7.1f}s {what}: job -> {seen}")
        else:
            lines.append(f"    #{e['idx']} {e['started_s']:7.1f}s {e['kind']}: not injected ({e.get('not_injected')})")
    left = doc.get("leftovers") or {}
    lines.append(
        "  after teardown: "
        + ("nothing left" if left.get("clean") else f"LEFT {left}" if left else "unknown (testbed never built)")
    )
    return lines
