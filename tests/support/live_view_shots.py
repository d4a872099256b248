"""Take the live view's screenshots in docs/ during a real run with a re-plan.

    PYTHONPATH=. python -m tests.support.live_view_shots [--out docs]

A ``fusion-coordinator --http`` and three workers train a small GPT-2; headless Chromium
signs in and takes ``live-view.png`` while the job runs on all three. Then one stage's
worker is killed (SIGKILL): the job loses it, re-plans onto the other two, restores and
goes on; ``live-view-replan.png`` shows the curve with those events marked. Every process
is stopped on the way out. Needs Chromium (``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from pathlib import Path

from PIL import Image

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from tests.support.browser import Browser, find_chromium

TOKEN = "live-view-screenshots"
STEPS = 400
KILL_AT_STEP = 60
AFTER_RESUME_STEPS = 50


def job_text(out: Path) -> str:
    return textwrap.dedent(f"""
        name = "gpt2-tiny-shots"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 8
        seq_len = 32
        [train]
        steps = {STEPS}
        micro_batches = 2
        optimizer = "adamw"
        lr = 0.003
        seed = 1
        [cluster]
        min_workers = 3
        [plan]
        strategy = "uniform"
        [checkpoint]
        replicate_every = 5
        [output]
        dir = "{out}"
        """)


def wait_step(client: CoordinatorClient, job_id: str, step: int, timeout_s: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = client.status(job_id)
        if s["state"] == "running" and s["step"] >= step:
            return s
        if s["state"] in ("succeeded", "failed", "cancelled"):
            raise RuntimeError(f"the job ended before step {step}: {s}")
        time.sleep(0.2)
    raise TimeoutError(f"the job did not reach step {step}")


def wait_event(client: CoordinatorClient, job_id: str, event: str, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in client.status(job_id)["events"] if e.get("event") == event]
        if found:
            return found[-1]
        time.sleep(0.2)
    raise TimeoutError(f"no {event} event in {timeout_s}s")


def take(browser: Browser, path: Path) -> None:
    time.sleep(2.5)  # two polls: the page shows the newest state
    browser.screenshot(path)
    # A palette of 256 colours keeps the PNG small; the page is flat colours and text.
    with Image.open(path) as shot:
        small = shot.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"), help="where the PNGs go (default: %(default)s)")
    args = parser.parse_args()
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("no Chromium binary on PATH: apt-get install chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fusion-shots-") as tmp, Fleet(Path(tmp) / "logs") as fleet:
        base = Path(tmp)
        fleet.start_coordinator(
            token=TOKEN,
            state_dir=base / "state",
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=4.0,
            extra_args=["--http", "127.0.0.1:0"],
        )
        url = fleet.processes.wait_for("coordinator", r"live view on (http://\S+/)", 10).group(1)
        names = ["lab-a", "lab-b", "home-c"]
        for name in names:
            fleet.start_worker(name, token=TOKEN, wait=False)
        fleet.wait_workers(names)
        (base / "job.toml").write_text(job_text(base / "out"))
        with CoordinatorClient(fleet.coordinator_address, TOKEN) as client, Browser(chromium, width=1360) as browser:
            job_id = client.submit(load_job(base / "job.toml"))
            browser.goto(url)
            browser.evaluate(
                f"document.querySelector('input[name=token]').value = {TOKEN!r}; "
                "document.querySelector('form').submit(); true"
            )
            browser.wait_for("!!document.getElementById('workers')")
            s = wait_step(client, job_id, KILL_AT_STEP)
            take(browser, args.out / "live-view.png")
            victim = s["plan"]["stages"][1]["worker"]
            print(f"killing {victim} at step {s['step']}", flush=True)
            fleet.workers[victim].kill()
            resumed = wait_event(client, job_id, "resumed_at_step")
            wait_step(client, job_id, int(resumed.get("step", KILL_AT_STEP)) + AFTER_RESUME_STEPS)
            take(browser, args.out / "live-view-replan.png")
            client.cancel(job_id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
