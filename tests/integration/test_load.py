"""A short run of the coordinator load test: 16 lightweight worker processes, no heartbeat lost.

The full run (64 workers for 5 minutes beside a real job) is ``python -m testbeds.bench.load_test``;
this one uses a 0.5 s heartbeat interval so that ~10 s give every worker about twenty
heartbeats, and no job (the job path is exercised by the security and recovery tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testbeds.bench.load_test import format_table, run_load

pytestmark = [pytest.mark.timeout(180), pytest.mark.quiet]


def test_sixteen_workers_heart_beat_without_loss(tmp_path: Path) -> None:
    r = run_load(
        workers=16,
        seconds=10,
        work_dir=tmp_path,
        real_workers=0,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=3.0,
        progress=False,
    )
    print(format_table(r))
    assert r["heartbeats_lost"] == 0 and r["heartbeats_failed"] == 0 and r["heartbeats_unknown"] == 0, r[
        "heartbeat_errors"
    ]
    assert r["heartbeats_acked"] >= 16 * 15, r["heartbeats_acked"]  # ~20 each over the window, more before it
    assert not r["declared_gone"] and r["declared_gone_in_log"] == 0
    assert r["max_heartbeat_age_seen_by_coordinator_s"] < 3.0
    assert r["deregistered"] == 16
    assert r["samples"] >= 8 and 0 < r["coordinator_rss_mib"]["max"] < 4096
