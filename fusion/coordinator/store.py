"""The coordinator's durable state: workers, jobs, events and metrics in one SQLite file.

Everything a restarted coordinator must still know lives here: finished jobs (with their
outputs and final loss), the log of every job, and the workers that were registered. The
job lifecycle is an explicit state machine (:data:`TRANSITIONS`); :meth:`Store.transition`
refuses anything else, so a job can never jump from ``succeeded`` back to ``running``.

SQLite in WAL mode with one connection guarded by a lock: the coordinator's write rate (a
few rows per training step) is far below what that serves.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion.errors import NotFoundError, StateError

logger = logging.getLogger(__name__)

JOB_STATES = ("pending", "planning", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})

#: Allowed job state changes. ``planning -> pending`` happens when workers vanish before
#: the job starts.
TRANSITIONS: dict[str, frozenset[str]] = {
    "pending": frozenset({"planning", "cancelled", "failed"}),
    "planning": frozenset({"running", "pending", "failed", "cancelled"}),
    # running -> pending: the coordinator restarted; the job resumes from its checkpoint.
    "running": frozenset({"succeeded", "failed", "cancelled", "pending"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}

#: ``excluded``: the worker sent poisoned tensors; it is never given work again.
WORKER_STATES = ("idle", "busy", "gone", "excluded")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    address TEXT NOT NULL,
    resources_json TEXT NOT NULL,
    session_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    job_id TEXT,
    registered_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    step INTEGER NOT NULL DEFAULT 0,
    steps INTEGER NOT NULL,
    loss REAL,
    samples_per_s REAL,
    output_dir TEXT NOT NULL,
    plan_json TEXT,
    workers_json TEXT,
    waiting TEXT
);
CREATE TABLE IF NOT EXISTS log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    record_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS log_by_job ON log (job_id, seq);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS profiles (
    key TEXT PRIMARY KEY,
    profile_json TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class WorkerRow:
    """A registered worker."""

    worker_id: str
    name: str
    address: str
    resources: dict[str, Any]
    session_hash: str
    state: str
    job_id: str | None
    registered_at: float
    last_heartbeat: float


@dataclass(frozen=True)
class JobRow:
    """A job and its progress."""

    job_id: str
    name: str
    spec_json: str
    state: str
    reason: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    step: int
    steps: int
    loss: float | None
    samples_per_s: float | None
    output_dir: str
    plan_json: str | None
    workers_json: str | None
    waiting: str | None = None
    """What a pending job waits for (e.g. worker memory), or ``None``."""

    @property
    def workers(self) -> list[str]:
        """Names of the workers the job runs on."""
        return json.loads(self.workers_json) if self.workers_json else []


class Store:
    """The SQLite file under the coordinator's state directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {r["name"] for r in self._db.execute("PRAGMA table_info(jobs)")}
            if "waiting" not in columns:  # a state file from before the column
                self._db.execute("ALTER TABLE jobs ADD COLUMN waiting TEXT")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------- workers
    def add_worker(
        self, *, worker_id: str, name: str, address: str, resources: dict[str, Any], session_hash: str
    ) -> None:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO workers VALUES (?, ?, ?, ?, ?, 'idle', NULL, ?, ?)",
                (worker_id, name, address, json.dumps(resources), session_hash, now, now),
            )

    def heartbeat(self, worker_id: str) -> bool:
        """Record a heartbeat; false if the worker is unknown or was declared gone."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE workers SET last_heartbeat = ? WHERE worker_id = ? AND state != 'gone'",
                (time.time(), worker_id),
            )
            return cur.rowcount == 1

    def set_worker_state(self, worker_id: str, state: str, job_id: str | None = None) -> None:
        if state not in WORKER_STATES:
            raise ValueError(f"unknown worker state {state!r}")
        with self._tx() as db:
            db.execute("UPDATE workers SET state = ?, job_id = ? WHERE worker_id = ?", (state, job_id, worker_id))

    def worker(self, worker_id: str) -> WorkerRow:
        with self._lock:
            row = self._db.execute("SELECT * FROM workers WHERE worker_id = ?", (worker_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no worker with id {worker_id!r}")
        return _worker(row)

    def workers(self, *states: str) -> list[WorkerRow]:
        """Workers in any of ``states`` (all if none given), oldest registration first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM workers ORDER BY registered_at, worker_id").fetchall()
        out = [_worker(r) for r in rows]
        return [w for w in out if not states or w.state in states]

    # ------------------------------------------------------------- jobs
    def add_job(self, *, job_id: str, name: str, spec_json: str, steps: int, output_dir: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, state, created_at, steps, output_dir) "
                "VALUES (?, ?, ?, 'pending', ?, ?, ?)",
                (job_id, name, spec_json, time.time(), steps, output_dir),
            )
            _append_log(db, job_id, "event", {"event": "submitted", "message": f"job {name!r} submitted"})

    def job(self, job_id: str) -> JobRow:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no job with id {job_id!r}")
        return JobRow(**dict(row))

    def jobs(self, *states: str) -> list[JobRow]:
        """Jobs in any of ``states`` (all if none given), oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY created_at, job_id").fetchall()
        out = [JobRow(**dict(r)) for r in rows]
        return [j for j in out if not states or j.state in states]

    def transition(self, job_id: str, state: str, reason: str | None = None) -> JobRow:
        """Move a job to ``state``; ``StateError`` if the state machine forbids it."""
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no job with id {job_id!r}")
            current = row["state"]
            if state not in TRANSITIONS[current]:
                raise StateError(f"job {job_id} cannot go from {current} to {state}")
            now = time.time()
            db.execute(
                "UPDATE jobs SET state = ?, reason = COALESCE(?, reason), "
                "started_at = CASE WHEN ? = 'running' THEN ? ELSE started_at END, "
                "finished_at = CASE WHEN ? IN ('succeeded', 'failed', 'cancelled') THEN ? ELSE finished_at END "
                "WHERE job_id = ?",
                (state, reason, state, now, state, now, job_id),
            )
            record = {
                "event": "state",
                "state": state,
                "message": f"{current} -> {state}" + (f": {reason}" if reason else ""),
            }
            _append_log(db, job_id, "event", record)
        return self.job(job_id)

    def set_plan(self, job_id: str, plan: dict[str, Any], worker_names: list[str]) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET plan_json = ?, workers_json = ? WHERE job_id = ?",
                (json.dumps(plan), json.dumps(worker_names), job_id),
            )

    def set_waiting(self, job_id: str, text: str | None) -> None:
        """Say what the job waits for (``None``: nothing)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET waiting = ? WHERE job_id = ?", (text, job_id))

    def set_progress(self, job_id: str, *, step: int, loss: float, samples_per_s: float) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET step = ?, loss = ?, samples_per_s = ? WHERE job_id = ?",
                (step, loss, samples_per_s, job_id),
            )

    # ------------------------------------------------------------- log
    def log(self, job_id: str, kind: str, record: dict[str, Any]) -> int:
        """Append an event or metric record to the job's log; returns its sequence number."""
        with self._tx() as db:
            return _append_log(db, job_id, kind, record)

    def log_records(
        self, job_id: str, *, after_seq: int = 0, kind: str | None = None
    ) -> list[tuple[int, float, str, dict[str, Any]]]:
        """(seq, time, kind, record) of the job's log after ``after_seq``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, ts, kind, record_json FROM log WHERE job_id = ? AND seq > ? ORDER BY seq",
                (job_id, after_seq),
            ).fetchall()
        return [
            (r["seq"], r["ts"], r["kind"], json.loads(r["record_json"]))
            for r in rows
            if kind is None or r["kind"] == kind
        ]

    # ------------------------------------------------------------- profiles
    def get_profile(self, key: str) -> str | None:
        """A cached model profile (JSON), by (model fingerprint, shapes, device) key."""
        with self._lock:
            row = self._db.execute("SELECT profile_json FROM profiles WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row["profile_json"])

    def put_profile(self, key: str, profile_json: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO profiles (key, profile_json, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET profile_json = excluded.profile_json, updated_at = excluded.updated_at",
                (key, profile_json, time.time()),
            )

    # ------------------------------------------------------------- checkpoints
    def add_checkpoint(self, job_id: str, *, step: int, path: str, sha256: str, size_bytes: int, keep: int) -> None:
        """Record a durable checkpoint; forget all but the newest ``keep`` of the job."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints (job_id, step, path, sha256, size_bytes, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, step, path, sha256, size_bytes, time.time()),
            )
            db.execute(
                "DELETE FROM checkpoints WHERE job_id = ? AND step NOT IN "
                "(SELECT step FROM checkpoints WHERE job_id = ? ORDER BY step DESC LIMIT ?)",
                (job_id, job_id, keep),
            )

    def checkpoints(self, job_id: str) -> list[tuple[int, str, str, int]]:
        """(step, path, sha256, size_bytes) of a job's recorded checkpoints, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT step, path, sha256, size_bytes FROM checkpoints WHERE job_id = ? ORDER BY step", (job_id,)
            ).fetchall()
        return [(int(r["step"]), str(r["path"]), str(r["sha256"]), int(r["size_bytes"])) for r in rows]

    # ------------------------------------------------------------- restart
    def recover(self) -> list[str]:
        """After a restart: jobs that were mid-flight wait again, every worker must re-register.

        A job that was planning or running goes back to ``pending``; when enough workers have
        re-registered it starts again from its newest durable checkpoint (or from step 0).
        Returns the ids of those jobs.
        """
        requeued = []
        for job in self.jobs("planning", "running"):
            self.transition(
                job.job_id,
                "pending",
                "the coordinator restarted; the job resumes from its last durable checkpoint once workers rejoin",
            )
            requeued.append(job.job_id)
        with self._tx() as db:
            db.execute("UPDATE workers SET state = 'gone', job_id = NULL WHERE state != 'excluded'")
        return requeued


def _append_log(db: sqlite3.Connection, job_id: str, kind: str, record: dict[str, Any]) -> int:
    cur = db.execute(
        "INSERT INTO log (job_id, ts, kind, record_json) VALUES (?, ?, ?, ?)",
        (job_id, time.time(), kind, json.dumps(record)),
    )
    return int(cur.lastrowid or 0)


def _worker(row: sqlite3.Row) -> WorkerRow:
    d = dict(row)
    d["resources"] = json.loads(d.pop("resources_json"))
    return WorkerRow(**d)
