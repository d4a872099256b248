"""The chaos harness's schedule: seeded, complete, spaced, and never starves the job."""

from __future__ import annotations

import pytest

from fusion.errors import ConfigError
from testbeds.chaos.schedule import KINDS, ScheduleConfig, count_by_kind, make_schedule

pytestmark = pytest.mark.timeout(60)

LONG = ScheduleConfig(minutes=120, events_per_minute=3, num_workers=4, min_workers=4, heartbeat_timeout_s=6.0)


def test_same_seed_same_schedule_and_another_seed_another() -> None:
    a = make_schedule(11, LONG)
    assert a == make_schedule(11, LONG)
    assert [e.to_dict() for e in a] == [e.to_dict() for e in make_schedule(11, LONG)]
    assert [e.to_dict() for e in a] != [e.to_dict() for e in make_schedule(12, LONG)]


def test_every_kind_appears_over_a_long_schedule() -> None:
    counts = count_by_kind(make_schedule(3, LONG))
    assert set(counts) == set(KINDS)
    assert all(n > 0 for n in counts.values()), counts


@pytest.mark.parametrize("seed", range(5))
def test_events_keep_the_recovery_gap_and_the_window(seed: int) -> None:
    cfg = ScheduleConfig(minutes=30, events_per_minute=4, min_gap_s=8.0, start_s=5.0)
    events = make_schedule(seed, cfg)
    assert len(events) >= 30
    assert events[0].at_s >= cfg.start_s
    for prev, nxt in zip(events, events[1:], strict=False):
        assert nxt.at_s >= prev.end_s + cfg.min_gap_s - 1e-9
    assert events[-1].end_s <= cfg.minutes * 60
    for e in events:
        if e.kind == "freeze":
            assert e.duration_s > cfg.heartbeat_timeout_s  # the coordinator must notice


@pytest.mark.parametrize("seed", range(10))
def test_no_kill_leaves_the_job_short_unless_a_join_follows(seed: int) -> None:
    cfg = ScheduleConfig(minutes=60, events_per_minute=4, num_workers=3, min_workers=3)
    live = cfg.num_workers
    for e in make_schedule(seed, cfg):
        if e.kind in ("kill", "leave"):
            if live - 1 < cfg.min_workers:
                assert e.replace, e  # the fleet would run dry: a replacement joins when it ends
            live += 0 if e.replace else -1
        elif e.kind == "join":
            live += 1
        assert live >= cfg.min_workers
        assert live <= cfg.num_workers + cfg.max_extra


def test_a_rate_and_kinds_shape_the_schedule() -> None:
    few = make_schedule(1, ScheduleConfig(minutes=30, events_per_minute=0.5))
    many = make_schedule(1, ScheduleConfig(minutes=30, events_per_minute=4))
    assert len(many) > 2 * len(few)
    only = make_schedule(1, ScheduleConfig(minutes=10, kinds=("freeze", "link_cut")))
    assert {e.kind for e in only} == {"freeze", "link_cut"}


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown event kind"):
        ScheduleConfig(minutes=1, kinds=("meteor",))
    with pytest.raises(ConfigError, match="minutes"):
        ScheduleConfig(minutes=0)
