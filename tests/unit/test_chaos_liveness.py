"""The chaos report's liveness figures: a restart is down from its kill to its first answer."""

from __future__ import annotations

import pytest

from testbeds.chaos.observe import liveness

pytestmark = pytest.mark.timeout(60)

T0 = 1000.0
RESTART = {"idx": 3, "kind": "coordinator_restart", "injected": True, "started_s": 10.0, "ended_s": 14.0}


def poll(t_s: float, ok: bool) -> dict:
    rec = {"t": T0 + t_s, "ok": ok, "latency_s": 0.01}
    return rec if ok else {**rec, "error": "UNAVAILABLE: Connection refused"}


def test_refused_polls_count_until_the_restarted_coordinator_first_answers() -> None:
    spawns = [
        {"start": 1, "pid": 1, "spawned_at": T0 - 30.0, "listening_at": T0 - 20.0},
        {"start": 2, "pid": 2, "spawned_at": T0 + 12.0, "listening_at": T0 + 14.0},
    ]
    polls = [poll(t, True) for t in range(10)]  # answered before the kill
    polls += [poll(t, False) for t in range(10, 17)]  # killed at 10 s; listening at 14 s, still refused
    polls += [poll(17, True), poll(18, False), poll(19, True)]  # first answer at 17 s, then one more refusal
    live = liveness(polls, [RESTART], T0, spawns)
    assert live["failed"] == 8
    assert live["failed_while_coordinator_down"] == 7
    assert live["failed_otherwise"] == 1
    assert [p["t_s"] for p in live["failed_otherwise_polls"]] == [18.0]
    (r,) = live["coordinator_restarts"]
    assert r["idx"] == 3 and r["killed_s"] == 10.0 and r["spawned_s"] == 12.0
    assert r["listening_after_spawn_s"] == 2.0
    assert r["first_answer_after_spawn_s"] == pytest.approx(5.01)
    assert r["down_s"] == pytest.approx(7.01)


def test_a_restart_that_never_answers_leaves_every_later_refusal_expected_and_no_downtime() -> None:
    spawns = [{"start": 2, "pid": 2, "spawned_at": T0 + 12.0, "listening_at": None}]
    polls = [poll(5, False)] + [poll(t, False) for t in range(10, 20)]
    live = liveness(polls, [RESTART], T0, spawns)
    assert live["failed_while_coordinator_down"] == 10
    assert live["failed_otherwise"] == 1  # the refusal at 5 s, before any kill
    assert live["coordinator_restarts"][0]["down_s"] is None
