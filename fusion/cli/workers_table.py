"""``fusion workers``: the coordinator's workers as a table, live ones first.

The coordinator keeps a row per registration: a worker that restarts under the same name
registers again with a new id, and its old row stays behind as ``gone``. The table shows
each worker id once; by default only live workers (``idle``, ``busy``), and of several live
rows with one name only the newest. ``--all`` adds the ``gone`` and ``excluded`` ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusion.wire import coordinator_pb2 as cpb

#: Workers that can be given work, in the order the table lists them.
LIVE_STATES = ("idle", "busy")

COLUMNS = ("NAME", "ID", "STATE", "DEVICE", "SPEED", "MEMORY", "MACHINE", "JOB", "HEARTBEAT", "ADDRESS")


def select_workers(workers: Sequence[cpb.WorkerInfo], *, include_gone: bool = False) -> list[cpb.WorkerInfo]:
    """The rows to show: one per worker id; live workers first (idle, then busy), then the
    others (with ``include_gone``), each group in registration order.

    ``workers`` comes in the coordinator's order, oldest registration first, so of several
    live rows sharing a name the last is the newest and the only one kept.
    """
    by_id: dict[str, cpb.WorkerInfo] = {}
    for w in workers:
        by_id[w.worker_id] = w
    rows = list(by_id.values())
    live = [w for w in rows if w.state in LIVE_STATES]
    newest_by_name = {w.name: w.worker_id for w in live}
    live = [w for w in live if newest_by_name[w.name] == w.worker_id]
    live.sort(key=lambda w: LIVE_STATES.index(w.state))  # stable: registration order within a state
    others = [w for w in rows if w.state not in LIVE_STATES] if include_gone else []
    return live + others


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``15.6 GiB``; ``-`` for 0 (not reported)."""
    if n <= 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    """How long ago, e.g. ``0.4s ago``, ``12s ago``, ``5m ago``, ``2h ago``."""
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s ago"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _cells(w: cpb.WorkerInfo) -> tuple[str, ...]:
    r = w.resources
    speed = f"{r.matmul_flops / 1e9:.1f} GFLOP/s" if r.matmul_flops else "-"
    # Rows that show one machine share its compute (the planner keeps a model whole there).
    machine = r.machine if len(r.machine) <= 20 else f"{r.machine[:8]}…{r.machine[-8:]}"
    return (
        w.name,
        w.worker_id,
        w.state,
        r.device or "-",
        speed,
        human_bytes(r.device_memory_bytes or r.memory_bytes),  # what the worker lends its stages
        machine or "-",
        w.job_id or "-",
        human_age(w.last_heartbeat_age_s),
        w.address,
    )


def format_workers(workers: Sequence[cpb.WorkerInfo], *, include_gone: bool = False) -> str:
    """The table ``fusion workers`` prints: a header row, then :func:`select_workers`'s rows;
    a one-line note instead when there are none."""
    rows = [_cells(w) for w in select_workers(workers, include_gone=include_gone)]
    if not rows:
        hidden = len(workers)
        return "no live workers" + (f" ({hidden} gone or excluded: fusion workers --all)" if hidden else "")
    widths = [max(len(c[i]) for c in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [COLUMNS, *rows]
    ]
    return "\n".join(lines)


__all__ = ["COLUMNS", "LIVE_STATES", "format_workers", "human_age", "human_bytes", "select_workers"]
