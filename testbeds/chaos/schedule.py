"""The seeded schedule of a chaos run: which event happens when, decided before the run.

A schedule is pure data drawn from one ``random.Random(seed)``: the same seed and the same
:class:`ScheduleConfig` give the same events, so a run that found a bug can be repeated.
Events never overlap: each one lasts ``duration_s`` (a freeze until the thaw, a cut until
the link comes back, a kill until its replacement starts) and the next one starts at least
``min_gap_s`` after it ended, so the job has time to recover between blows.

Which worker an event hits is not known in advance (workers come and go): an event carries
``target_idx``, and the injector takes ``live[target_idx % len(live)]`` at its time.

The schedule models the fleet's size: a kill or a Ctrl-C leave that would leave fewer
workers than the job needs (``min_workers``) carries ``replace = True`` (a new worker joins
when the event ends), and a join is only drawn while the fleet is below ``max_extra`` above
its starting size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from fusion.errors import ConfigError

#: Every kind of event, in the order the report lists them.
KINDS: tuple[str, ...] = (
    "kill",
    "freeze",
    "link_cut",
    "bandwidth_collapse",
    "slow_loris",
    "join",
    "leave",
    "coordinator_restart",
    "disk_full",
)


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """What a schedule is drawn from."""

    minutes: float
    """Length of the injection window (events start within it)."""
    events_per_minute: float = 2.0
    """Mean rate of events; the gaps between them are at least ``min_gap_s``."""
    num_workers: int = 4
    """Workers at the start."""
    min_workers: int = 1
    """Workers the job needs: a kill or leave below this is followed by a replacement."""
    heartbeat_timeout_s: float = 6.0
    """The coordinator's heartbeat timeout: freezes last longer than it."""
    min_gap_s: float = 8.0
    """Quiet time after an event ends before the next one starts (recovery time)."""
    start_s: float = 5.0
    """No event before this (the job settles into training)."""
    max_extra: int = 2
    """Joins stop once the fleet is this many workers above its starting size."""
    kinds: tuple[str, ...] = KINDS
    """The kinds to draw from (all by default)."""

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ConfigError(f"--minutes must be positive, got {self.minutes}")
        if not self.events_per_minute > 0:
            raise ConfigError(f"--events-per-minute must be positive, got {self.events_per_minute}")
        if self.num_workers < 1 or self.min_workers < 1:
            raise ConfigError(f"a chaos run needs at least one worker (got {self.num_workers}, min {self.min_workers})")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ConfigError(f"unknown event kind(s) {unknown}; choose from {', '.join(KINDS)}")


@dataclass(frozen=True, kw_only=True)
class Event:
    """One scheduled event. Times are seconds from the moment the job starts training."""

    idx: int
    """Position in the schedule."""
    kind: str
    """One of :data:`KINDS`."""
    at_s: float
    """When it starts."""
    duration_s: float
    """How long it lasts (0 for a join or a coordinator kill whose restart is immediate)."""
    target_idx: int
    """Which live worker or host it hits: ``live[target_idx % len(live)]``."""
    replace: bool = False
    """Kill and leave: a new worker joins when the event ends."""
    params: dict[str, Any] = field(default_factory=dict)
    """Kind-specific numbers (``fraction`` of a bandwidth collapse, ``mode`` of a slow-loris)."""

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "idx": self.idx,
            "kind": self.kind,
            "at_s": round(self.at_s, 3),
            "duration_s": round(self.duration_s, 3),
            "target_idx": self.target_idx,
            "replace": self.replace,
            "params": dict(self.params),
        }


def _duration(kind: str, rng: random.Random, cfg: ScheduleConfig) -> tuple[float, dict[str, Any]]:
    """How long an event of ``kind`` lasts, and its parameters."""
    hb = cfg.heartbeat_timeout_s
    if kind == "kill" or kind == "leave":
        return rng.uniform(3.0, 8.0), {}
    if kind == "freeze":
        return hb + rng.uniform(2.0, 6.0), {}
    if kind == "link_cut":
        return rng.uniform(2.0, hb + 4.0), {}
    if kind == "bandwidth_collapse":
        return rng.uniform(5.0, 15.0), {"fraction": rng.choice((0.01, 0.05, 0.1))}
    if kind == "slow_loris":
        return rng.uniform(5.0, 15.0), {
            "mode": rng.choice(("trickle", "no_read")),
            "at": rng.choice(("worker", "coordinator")),
            "connections": rng.randint(4, 16),
        }
    if kind == "coordinator_restart":
        return rng.uniform(1.0, 5.0), {}
    if kind == "disk_full":
        return rng.uniform(5.0, 20.0), {}
    return 0.0, {}  # join


def make_schedule(seed: int, cfg: ScheduleConfig) -> list[Event]:
    """The events of a run, in time order; a pure function of ``seed`` and ``cfg``."""
    rng = random.Random(seed)
    window_s = cfg.minutes * 60.0
    mean_gap_s = 60.0 / cfg.events_per_minute
    events: list[Event] = []
    live = cfg.num_workers
    t = cfg.start_s
    while True:
        allowed = [k for k in cfg.kinds if k != "join" or live < cfg.num_workers + cfg.max_extra]
        kind = rng.choice(allowed)
        duration_s, params = _duration(kind, rng, cfg)
        if t + duration_s > window_s:
            break
        replace = False
        if kind in ("kill", "leave"):
            replace = live - 1 < max(cfg.min_workers, cfg.num_workers)
            live += 0 if replace else -1
        elif kind == "join":
            live += 1
        events.append(
            Event(
                idx=len(events),
                kind=kind,
                at_s=t,
                duration_s=duration_s,
                target_idx=rng.randrange(1 << 16),
                replace=replace,
                params=params,
            )
        )
        # Exponential spacing around the mean rate, never closer than the recovery gap.
        t += duration_s + max(cfg.min_gap_s, rng.expovariate(1.0 / max(mean_gap_s - duration_s, 1e-3)))
    return events


def count_by_kind(events: list[Event]) -> dict[str, int]:
    """How many events of each kind (every kind listed, zeros included)."""
    return {k: sum(1 for e in events if e.kind == k) for k in KINDS}
