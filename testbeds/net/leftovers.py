"""Find and remove what testbeds left behind (``python -m testbeds down``).

A testbed torn down normally leaves nothing. One whose owner was SIGKILLed leaves its
network namespaces (with their veths and bridge), the processes it spawned (they run in
their own sessions, so they outlive it) and its temp dir. All three carry the testbed
prefix ``fz<owner pid>…-``: namespaces and temp dirs in their names, processes in their
``FUSION_TESTBED`` environment variable. By default only leftovers of owners that are no
longer alive are removed, so a ``down`` never breaks a testbed that is still in use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbeds.net.testbed import PREFIX_RE, TESTBED_ENV, netns_available, owner_pid, pid_alive

logger = logging.getLogger(__name__)


@dataclass
class Leftovers:
    """What a sweep found (and removed, unless it was a dry run)."""

    namespaces: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.pids or self.dirs)


def _stale(name: str, everything: bool) -> bool:
    pid = owner_pid(name)
    return pid is not None and (everything or not pid_alive(pid))


def _protected_pids() -> set[int]:
    """This process and its ancestors: never killed, even when they carry a testbed mark."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def marked_processes() -> dict[int, str]:
    """Every process whose environment has ``FUSION_TESTBED``, with its prefix."""
    found: dict[int, str] = {}
    key = TESTBED_ENV.encode() + b"="
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(key):
                found[int(d.name)] = item[len(key) :].decode(errors="replace")
                break
    return found


def sweep(*, everything: bool = False, dry_run: bool = False) -> Leftovers:
    """Remove leftovers of dead testbed owners (of every testbed with ``everything``)."""
    out = Leftovers()
    protected = _protected_pids()
    victims = {pid: p for pid, p in marked_processes().items() if pid not in protected and _stale(p, everything)}
    out.pids = sorted(victims)
    if not dry_run and victims:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in victims):
                time.sleep(0.05)
    ok, why = netns_available()
    if ok:
        from testbeds.net.netns import delete_namespace, list_namespaces

        out.namespaces = [ns for ns in list_namespaces() if PREFIX_RE.match(ns) and _stale(ns, everything)]
        if not dry_run:
            for ns in out.namespaces:
                delete_namespace(ns)
    elif os.geteuid() != 0:
        logger.info("not root: namespaces (if any) were not checked (%s)", why)
    tmp = Path(tempfile.gettempdir())
    out.dirs = sorted(
        str(d) for d in tmp.glob("fz*-*") if d.is_dir() and PREFIX_RE.match(d.name) and _stale(d.name, everything)
    )
    if not dry_run:
        for d in out.dirs:
            shutil.rmtree(d, ignore_errors=True)
    return out
