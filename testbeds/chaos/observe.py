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


def liveness(polls: list[dict[str, Any]], events: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Status polls: how many, how many failed (apart from while the harness had the coordinator
    down, and 5 s after its restart), the longest answer."""
    down = [(e["started_s"], e.get("ended_s", e["started_s"]) + 5.0) for e in events
            if e["kind"] == "coordinator_restart" and e["injected"]]  # fmt: skip
    failed = [p for p in polls if not p.get("ok")]
    expected = [p for p in failed if any(a <= p["t"] - t0 + 1.0 and p["t"] - t0 <= b + 1.0 for a, b in down)]
    ok = [p["latency_s"] for p in polls if p.get("ok")]
    return {
        "polls": len(polls),
        "failed": len(failed),
        "failed_while_coordinator_down": len(expected),
        "failed_otherwise": len(failed) - len(expected),
        "max_latency_s": max(ok) if ok else None,
        "errors": sorted({p.get("error", "") for p in failed})[:10],
    }
