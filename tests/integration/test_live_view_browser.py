"""The live view in a real headless Chromium, over a real coordinator and workers.

A ``fusion-coordinator --http`` and two ``fusion-worker`` processes run a small GPT-2 job;
Chromium signs in through the login form (the cookie), and the page must show the workers
and the job, its plan, and a loss curve whose point count grows while the job runs.
Skipped, with the reason, where no Chromium binary is installed (CI installs Debian's).
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from tests.support.browser import Browser, find_chromium

TOKEN = "live-view-browser-token"
CHROMIUM = find_chromium()
pytest.importorskip("websocket", reason="websocket-client (of the test extra) drives Chromium")

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary on PATH (apt-get install chromium)"),
]


def write_job(path: Path, out: Path, steps: int) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "live-view"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = {steps}
        micro_batches = 2
        seed = 3
        [cluster]
        min_workers = 2
        [plan]
        strategy = "uniform"
        [output]
        dir = "{out}"
        """)
    )
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path / "logs") as f:
        f.start_coordinator(
            token=TOKEN,
            state_dir=tmp_path / "state",
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=5.0,
            extra_args=["--http", "127.0.0.1:0"],
        )
        for name in ("w0", "w1"):
            f.start_worker(name, token=TOKEN, wait=False)
        f.wait_workers(["w0", "w1"])
        yield f


def points(browser: Browser) -> int:
    return int(browser.evaluate("Number(document.getElementById('loss-chart').dataset.points)"))


def test_page_renders_workers_job_and_a_growing_loss_curve(fleet: Fleet, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    url = fleet.processes.wait_for("coordinator", r"live view on (http://\S+/)", 10).group(1)
    with CoordinatorClient(fleet.coordinator_address, TOKEN) as client, Browser(CHROMIUM) as browser:
        job_id = client.submit(load_job(write_job(tmp_path / "job.toml", tmp_path / "out", steps=2000)))
        browser.goto(url)
        # Not signed in: the login form, and no data.
        assert browser.evaluate("!!document.querySelector('form[action=\"/login\"]')")
        assert not browser.evaluate("!!document.getElementById('workers')")
        browser.evaluate(
            f"document.querySelector('input[name=token]').value = {TOKEN!r}; "
            "document.querySelector('form').submit(); true"
        )
        browser.wait_for("!!document.getElementById('workers')")
        assert browser.evaluate("document.cookie") == ""  # HttpOnly: not readable by scripts
        names = browser.wait_for(
            "(() => { const n = [...document.querySelectorAll('#workers tr.worker td:first-child')]"
            ".map(td => td.textContent).sort(); return n.length === 2 ? n : null; })()"
        )
        assert names == ["w0", "w1"]
        browser.wait_for(f"!!document.querySelector('#jobs tr.job[data-id=\"{job_id}\"]')")
        # The job is selected, planned, and steps are drawn.
        browser.wait_for("document.querySelectorAll('#stages tr.stage').length === 2", timeout_s=180)
        browser.wait_for("Number(document.getElementById('loss-chart').dataset.points) >= 3", timeout_s=120)
        first = points(browser)
        title = browser.evaluate("document.getElementById('job-title').textContent")
        assert job_id in title and "running" in title
        time.sleep(4)
        second = points(browser)
        assert client.status(job_id)["state"] == "running"
        assert second > first, (first, second)
        assert browser.evaluate("document.querySelectorAll('#loss-chart polyline.ema').length") == 1
        assert browser.evaluate("document.querySelectorAll('#links tbody td.num').length") >= 2
        assert "not updated" not in browser.evaluate("document.getElementById('updated').textContent")
        client.cancel(job_id)
