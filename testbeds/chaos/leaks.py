"""What a chaos run leaves behind: processes, threads, open files and the coordinator's memory.

Read from ``/proc``: the processes the fleet started that are still alive, the
coordinator's open file descriptors (``/proc/PID/fd``), threads (``/proc/PID/task``) and
resident memory (``VmRSS``), and, after teardown, every process that still carries this
testbed's mark and every namespace or mount it made.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from testbeds.net.leftovers import marked_processes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessFacts:
    """One process's open files, threads and resident memory (None where unreadable: it is gone)."""

    pid: int
    num_fds: int | None
    num_threads: int | None
    rss_bytes: int | None


def process_facts(pid: int) -> ProcessFacts:
    """Read ``pid``'s fd count, thread count and VmRSS from ``/proc``."""
    base = Path(f"/proc/{pid}")
    try:
        num_fds: int | None = len(os.listdir(base / "fd"))
    except OSError:
        num_fds = None
    try:
        num_threads: int | None = len(os.listdir(base / "task"))
    except OSError:
        num_threads = None
    rss: int | None = None
    try:
        for line in (base / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return ProcessFacts(pid=pid, num_fds=num_fds, num_threads=num_threads, rss_bytes=rss)


def snapshot(alive_started: list[int], coordinator_pid: int | None) -> dict[str, Any]:
    """The fleet's figures now: processes started and alive, and the coordinator's facts."""
    coord = process_facts(coordinator_pid) if coordinator_pid else None
    return {
        "num_processes": len(alive_started),
        "coordinator": asdict(coord) if coord else None,
    }


class CoordinatorSampler:
    """Samples the coordinator's facts every ``interval_s`` on a thread, with its pid and the
    job's state then: after a coordinator restart, memory growth is measured from the new
    process's first sample while the job runs (:func:`restart_baseline`)."""

    def __init__(
        self, pid_of: Callable[[], int | None], state_of: Callable[[], str | None], interval_s: float = 5.0
    ) -> None:
        self.pid_of = pid_of
        self.state_of = state_of
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-coordinator-sampler", daemon=True)

    def start(self) -> CoordinatorSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            pid = self.pid_of()
            if pid is None:
                continue
            facts = process_facts(pid)
            if facts.rss_bytes is not None:
                self.samples.append({"t": time.time(), "state": self.state_of(), **asdict(facts)})

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return list(self.samples)


def restart_baseline(samples: list[dict[str, Any]], pid: int | None) -> dict[str, Any] | None:
    """The first sample of coordinator ``pid`` taken once the job runs again after the
    restart that started it, as the first baseline is taken at training start: the job goes
    back to ``pending`` and ``planning`` first, so samples before it left ``running`` carry
    the state the poller last saw of the old process. ``None`` without such a sample."""
    mine = [s for s in samples if s["pid"] == pid]
    left = next((i for i, s in enumerate(mine) if s.get("state") != "running"), None)
    if left is None:
        return None
    return next((s for s in mine[left:] if s.get("state") == "running"), None)


def growth_pct(before: int | None, after: int | None) -> float | None:
    """``after`` over ``before`` in percent above 100 (None when either is missing)."""
    if not before or after is None:
        return None
    return 100.0 * (after - before) / before


def leftovers(prefix: str, mounts: list[str]) -> dict[str, Any]:
    """What is left after teardown: marked processes of ``prefix``, its namespaces, the mounts."""
    pids = sorted(pid for pid, p in marked_processes().items() if p == prefix)
    namespaces: list[str] = []
    if Path("/run/netns").is_dir():
        namespaces = sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix))
    mounted = Path("/proc/self/mounts").read_text().split("\n")
    still = [m for m in mounts if any(f" {m} " in line for line in mounted)]
    return {"processes": pids, "namespaces": namespaces, "mounts": still, "clean": not (pids or namespaces or still)}
