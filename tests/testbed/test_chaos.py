"""The chaos harness on a real netns testbed: a short run, its report, and nothing left behind.

Needs root (network namespaces, ``tc``, a tmpfs); skipped otherwise. Four hosts, GPT-2 tiny
split over every worker, a one-minute window of events of several kinds (the seed's
schedule is checked first). The point is the harness: events are injected and reported with
what the job did, the report has its structure, and every process, namespace and mount is
gone at the end. A job that fails under the events is accepted only when the report names
why. The uninterrupted reference run is left out (``--no-reference``: it would double the
test's two minutes); the model comparison is tested on its own
(``tests/unit/test_chaos_compare.py``), and the committed soak compares for real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the netns testbed needs root"),
    pytest.mark.timeout(1500),
]

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "testbeds" / "jobs" / "chaos-gpt2-tiny.toml"
SEED = 2
MINUTES = 1.0
RATE = 8.0


def test_short_chaos_run_reports_and_reaps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from testbeds.chaos.__main__ import main
    from testbeds.chaos.schedule import ScheduleConfig, make_schedule
    from testbeds.net.leftovers import marked_processes
    from testbeds.net.testbed import netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    schedule = make_schedule(SEED, ScheduleConfig(minutes=MINUTES, events_per_minute=RATE))
    assert len(schedule) >= 5 and len({e.kind for e in schedule}) >= 4, [e.kind for e in schedule]

    out = tmp_path / "chaos.json"
    argv = ["--topology", "two-sites", "--job", str(JOB), "--minutes", str(MINUTES), "--seed", str(SEED),
            "--events-per-minute", str(RATE), "--steps", "300", "--json", str(out),
            "--log-dir", str(tmp_path / "logs"), "--job-timeout", "420", "--no-reference"]  # fmt: skip
    rc = main(argv)
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())

    assert "error" not in doc, doc.get("error")
    assert "chaos report:" in printed and "events injected:" in printed
    assert doc["backend"] == "netns" and doc["seed"] == SEED
    assert [e["kind"] for e in doc["schedule"]] == [e.kind for e in schedule]  # the seed's schedule, as drawn
    summary = doc["summary"]
    for key in ("finished", "model_equal", "injected_by_kind", "processes_before", "coordinator_fds",
                "coordinator_threads", "coordinator_rss_growth_pct", "liveness", "leftovers_clean"):  # fmt: skip
        assert key in summary, key
    chaos = doc["chaos"]
    events = chaos["events"]
    assert events, "no event ran"
    for e in events:
        assert e["injected"] or e["not_injected"], e  # an event not injected says why
        assert f"#{e['idx']} " in printed
    if chaos["finished"]:
        assert summary["events_injected"] >= 5, summary
        assert len(summary["injected_by_kind"]) >= 3, summary
        assert summary["model_equal"] is None and "not compared" in printed  # --no-reference
    else:
        assert chaos["state"] in ("failed", "cancelled", "running", None)
        assert chaos["reason"] or chaos["state"] != "failed", "a failed job's report names the reason"
        assert f"job {chaos['job_id']}: {chaos['state']}" in printed
    live = summary["liveness"]
    assert live["polls"] > 30 and live["max_latency_s"] is not None
    # The harness reaped everything: its processes, the testbed's namespaces, the tmpfs.
    assert summary["processes_after_stop"] == 0
    assert doc["leftovers"]["clean"], doc["leftovers"]
    assert not [pid for pid, prefix in marked_processes().items() if prefix == doc["prefix"]]
    assert rc in (0, 1)
