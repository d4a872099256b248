"""What the chaos harness sees of the job: the status poller's lines, read as they come.

:class:`Poller` keeps every ``GetJob`` answer of ``testbeds.chaos.poller`` (liveness) and
every job event (what the job did); :func:`attribute_reactions` gives each injected event
the job events that followed it, and :func:`liveness` the poll figures.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Job events of routine work: kept in the report, not printed as they happen.
QUIET_EVENTS = ("checkpoint", "measured")


def parse_poll_line(line: str) -> dict | None:
    """One poller record, or None for a line that is not one."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "t" in doc else None


@dataclass
class Poller:
    """Reads the status poller's lines: liveness figures and the job's events as they come."""

    proc: subprocess.Popen
    t0: float
    echo: Callable[[str], None]
    records: list[dict[str, Any]] = field(default_factory=list)
    job_events: list[dict[str, Any]] = field(default_factory=list)
    """Every job event seen, ``t_s`` from :attr:`t0`."""
    live: bool = False
    """Print job events as they arrive (once the events start)."""

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, name="chaos-poller", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            rec = parse_poll_line(line)
            if rec is None:
                continue
            self.records.append(rec)
            for e in rec.get("events") or []:
                item = {"time": float(e.get("time", rec["t"])), "event": e.get("event"), "message": e.get("message")}
                self.job_events.append(item)
                if self.live and item["event"] not in QUIET_EVENTS:
                    self.echo(f"      {item['time'] - self.t0:7.1f}s  job: {item['event']}: {item['message']}")

    def last_ok(self) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if r.get("ok")), None)

    def state(self) -> str | None:
        r = self.last_ok()
        return r["state"] if r else None


def attribute_reactions(job_events: list[dict[str, Any]], records: list[dict[str, Any]], t0: float) -> list[dict]:
    """Give each injected record the job events from its start to the next injected one's;
    return the job events before the first."""
    starts = [r for r in records if r["injected"]]
    before: list[dict[str, Any]] = []
    for r in records:
        r["reactions"] = []
    for e in sorted(job_events, key=lambda e: e["time"]):
        item = {"t_s": round(e["time"] - t0, 1), "event": e["event"], "message": e["message"]}
        owner = None
        for r in starts:
            if r["started_s"] <= item["t_s"] + 0.05:
                owner = r
        (owner["reactions"] if owner else before).append(item)
    return before


#: What the report calls a coordinator restart's downtime.
DOWN_DEFINITION = (
    "a coordinator restart's downtime runs from the harness's SIGKILL until the restarted process first "
    "answers a status poll; every other failed poll, before or after, counts as failed"
)


def restart_downtimes(
    polls: list[dict[str, Any]], events: list[dict[str, Any]], spawns: list[dict[str, Any]], t0: float
) -> list[dict[str, Any]]:
    """Each injected coordinator restart: when it was killed (``killed_s``, from ``t0``), when
    the new process was spawned and printed that it listens, when it first answered a status
    poll, and the downtime from the kill to that answer (``None`` when it never answered)."""
    out = []
    for e in events:
        if e["kind"] != "coordinator_restart" or not e["injected"]:
            continue
        killed_at = t0 + e["started_s"]
        spawn = next((s for s in spawns if s["spawned_at"] >= killed_at), None)
        first = None
        if spawn is not None:
            first = next(
                (p for p in polls if p.get("ok") and p["t"] + p.get("latency_s", 0.0) >= spawn["spawned_at"]), None
            )
        answered_at = first["t"] + first.get("latency_s", 0.0) if first else None
        out.append(
            {
                "idx": e["idx"],
                "killed_s": e["started_s"],
                "spawned_s": round(spawn["spawned_at"] - t0, 1) if spawn else None,
                "listening_after_spawn_s": round(spawn["listening_at"] - spawn["spawned_at"], 2)
                if spawn and spawn.get("listening_at")
                else None,
                "first_answer_after_spawn_s": round(answered_at - spawn["spawned_at"], 2)
                if spawn and answered_at
                else None,
                "down_s": round(answered_at - killed_at, 2) if answered_at else None,
                "_window": (killed_at, answered_at if answered_at is not None else float("inf")),
            }
        )
    return out


def liveness(
    polls: list[dict[str, Any]], events: list[dict[str, Any]], t0: float, spawns: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Status polls: how many, how many failed while a restarted coordinator was down (from
    its kill to its first answer, :func:`restart_downtimes`) and how many failed otherwise,
    the longest answer, and each restart's downtime. ``spawns``: the fleet's coordinator
    starts (``spawned_at``, ``listening_at``, wall time)."""
    restarts = restart_downtimes(polls, events, spawns or [], t0)
    windows = [r.pop("_window") for r in restarts]
    failed = [p for p in polls if not p.get("ok")]
    expected = [p for p in failed if any(a <= p["t"] + p.get("latency_s", 0.0) and p["t"] < b for a, b in windows)]
    others = [p for p in failed if p not in expected]
    ok = [p["latency_s"] for p in polls if p.get("ok")]
    return {
        "polls": len(polls),
        "failed": len(failed),
        "failed_while_coordinator_down": len(expected),
        "failed_otherwise": len(others),
        "max_latency_s": max(ok) if ok else None,
        "errors": sorted({p.get("error", "") for p in failed})[:10],
        "failed_otherwise_polls": [
            {"t_s": round(p["t"] - t0, 1), "latency_s": p.get("latency_s"), "error": p.get("error")} for p in others
        ][:50],
        "coordinator_restarts": restarts,
        "down_definition": DOWN_DEFINITION,
    }
