"""The split regime's metrics per system: time to a target loss and each host's peak memory.

- ``time_to_target_s``: the target is the final loss of a dense run over the same steps,
  ``pipelining-best``'s or, without it, ``fusion-dense``'s
  (:data:`testbeds.bench.systems.TARGET_SYSTEMS`). A run's per-step loss is noisy (each
  step sees another batch), so for a run of ``n`` steps the final loss is the mean of its
  last :func:`loss_window` ``(n)`` steps (5 %: the last step alone below 40 steps, the
  last 50 of 1,000). A system reaches the target at the first step whose loss averaged over
  the same window ending there is at or below it (within :data:`LOSS_RTOL`: the same loss
  summed in another order differs in its last float32 bits, and a run that matches the
  target's curve step for step must reach it); below 40 steps, where the window is one
  step, the raw loss or its mean over the last :data:`SMOOTHING` steps counts. Its time to
  target is that step's count (``step + 1``) times the system's measured step seconds (the
  row's ``step_s``, trimmed and warm). ``None`` when it never does, or when there is no
  target. A compressed run may be given more steps than the target's (``--overrun``), so
  that one whose loss trails the target's at the last shared step can still reach it; its
  ``loss_at_target_steps`` is then its final loss over the target's steps only, the
  like-for-like "final loss vs dense".
- ``peak_memory_bytes``: ``{host: bytes}``, the most any step measured on that host, and
  ``memory_cap_bytes``: ``{host: bytes}``, what the host lends (its ``memory_gb``). Fleet
  systems read both from ``measured.json``'s ``memory`` section (each stage's
  ``measured_peak_bytes``, summed per worker); rank systems from the ranks' own
  measurement (:mod:`testbeds.bench.baselines.memory`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from testbeds.bench.systems import TARGET_SYSTEMS

logger = logging.getLogger(__name__)

#: Steps in the moving average a loss is smoothed over.
SMOOTHING = 3

#: Relative slack on the target: float32 summation order. A ResNet run equal to the target's
#: step for step ended 7.5e-8 relative above it; GPT-2 mini cut at other layers than GPipe's
#: read 3.0e-6 relative off GPipe's loss on its very first forward pass (the same weights and
#: batch) and 3.3e-6 after 10 steps. A compressed run misses by 1e-3 or more.
LOSS_RTOL = 1e-5


def loss_window(steps: int) -> int:
    """Steps a final loss is averaged over at the end of a run of ``steps`` (5 %, at least 1)."""
    return max(1, steps // 20)


def overrun_steps(steps: int, overrun: float) -> int:
    """Steps a system other than the target runs with ``--overrun``: ``ceil(steps * (1 + overrun))``."""
    return math.ceil(steps * (1 + overrun))


def final_loss(losses: Sequence[float]) -> float | None:
    """The mean of the last :func:`loss_window` losses (``None`` without any)."""
    if not losses:
        return None
    tail = losses[-loss_window(len(losses)) :]
    return sum(tail) / len(tail)


def steps_to_target(losses: Sequence[float], target: float, *, window: int = 1) -> int | None:
    """The first step (0-based) whose loss, averaged over ``window`` steps ending there, is at
    or below ``target`` (within :data:`LOSS_RTOL`); with ``window == 1``, the raw loss or
    its mean over the last :data:`SMOOTHING` steps (module docstring)."""
    bar = target + abs(target) * LOSS_RTOL
    smooth = SMOOTHING if window == 1 else window  # the target's own window: dense reaches its target
    for i, loss in enumerate(losses):
        recent = losses[max(0, i + 1 - smooth) : i + 1]
        if window == 1 and loss <= bar:
            return i
        if i + 1 >= window and sum(recent) / len(recent) <= bar:
            return i
    return None


def time_to_target(
    losses: Sequence[float], step_s: float | None, target: float | None, *, window: int = 1
) -> float | None:
    """Seconds to reach ``target`` at ``step_s`` a step (module docstring)."""
    if target is None or step_s is None or not losses:
        return None
    step = steps_to_target(losses, target, window=window)
    return None if step is None else (step + 1) * step_s


def fleet_peak_memory(measured: Mapping[str, Any] | None) -> tuple[dict[str, int], dict[str, int]]:
    """``({worker: measured peak bytes}, {worker: cap bytes})`` from a fleet job's ``measured.json``."""
    peaks: dict[str, int] = {}
    caps: dict[str, int] = {}
    for stage in ((measured or {}).get("memory") or {}).get("stages", []):
        worker = stage.get("worker")
        if worker is None:
            continue
        if stage.get("measured_peak_bytes") is not None:
            peaks[worker] = peaks.get(worker, 0) + int(stage["measured_peak_bytes"])
        if stage.get("cap_bytes") is not None:
            caps[worker] = int(stage["cap_bytes"])
    return peaks, caps


def rank_peak_memory(records: Sequence[Mapping[str, Any]], hosts: Sequence[str]) -> dict[str, int]:
    """``{host: peak bytes}`` from rank records (``peak_memory_bytes`` by rank)."""
    out: dict[str, int] = {}
    for record in records:
        for rank, size in (record.get("peak_memory_bytes") or {}).items():
            host = hosts[int(rank)]
            out[host] = max(out.get(host, 0), int(size))
    return out


def target_system(systems: Sequence[str]) -> str | None:
    """The system whose final loss is the target: the first of :data:`TARGET_SYSTEMS` run."""
    return next((s for s in TARGET_SYSTEMS if s in systems), None)


def add_split_metrics(
    rows: dict[str, dict[str, Any]], caps: Mapping[str, int | None]
) -> tuple[str | None, float | None]:
    """Add ``time_to_target_s`` to every row, and fill each row's ``memory_cap_bytes`` from
    ``caps`` (the topology's, ``{host: bytes}``) for the hosts it used; returns the target's
    system and loss."""
    system = target_system(list(rows))
    target_row = rows.get(system) or {}
    target_losses = target_row.get("losses") or []
    window = loss_window(len(target_losses))
    target = final_loss(target_losses) if window > 1 else target_row.get("final_loss")
    for row in rows.values():
        losses = row.get("losses") or []
        row["target_loss"] = target
        row["time_to_target_s"] = time_to_target(losses, row.get("step_s"), target, window=window)
        row["loss_at_target_steps"] = final_loss(losses[: len(target_losses)]) if target_losses else None
        row.setdefault("peak_memory_bytes", {})
        lent = row.setdefault("memory_cap_bytes", {})
        for host in row.get("hosts_used") or []:
            if caps.get(host) is not None:
                lent.setdefault(host, caps[host])
    return system, target


def _window_words(doc: Mapping[str, Any]) -> str:
    window = loss_window(int(doc.get("steps") or 0))
    return f", the mean of its last {window} steps" if window > 1 else ""


def dash(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``-`` for ``None``."""
    return "-" if value is None else format(value, spec)


def split_lines(doc: Mapping[str, Any]) -> list[str]:
    """The table of time to target and peak memory against caps (empty for a result without them)."""
    rows = doc.get("systems", {})
    if not any("time_to_target_s" in r for r in rows.values()):
        return []
    from fusion.memory import format_bytes

    target = doc.get("target_loss")
    lines = [
        "",
        f"target loss: {'-' if target is None else f'{target:.4f}'} "
        f"({doc.get('target_system') or TARGET_SYSTEMS[0]}'s final loss{_window_words(doc)})",
        "",
        "| system | steps run | loss at the target's steps | time to target s | peak memory / cap per host |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        caps = r.get("memory_cap_bytes") or {}
        mem = ", ".join(
            f"{h} {format_bytes(b)}" + (f" / {format_bytes(caps[h])}" if caps.get(h) else "")
            for h, b in (r.get("peak_memory_bytes") or {}).items()
        )
        lines.append(
            f"| {name} | {len(r.get('losses') or []) or '-'} | {dash(r.get('loss_at_target_steps'), '.4f')} | "
            f"{dash(r.get('time_to_target_s'), '.4g')} | {mem or '-'} |"
        )
    return lines
