"""The long-lived coordinator keeps no plotting library: ``loss.png`` is drawn by a child.

Matplotlib costs a process tens of MiB that it keeps for as long as it runs; the
coordinator's job outputs draw the loss curve in a short-lived ``python -m
fusion.coordinator.loss_plot`` process instead, and a failing one costs the plot, not the job.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fusion.coordinator.outputs import LOSS_PLOT_FILE, METRICS_FILE, JobOutputs
from fusion.launch import child_env

pytestmark = pytest.mark.timeout(120)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: A coordinator's imports, then its end-of-job plot, in a fresh interpreter.
PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import fusion.coordinator.service  # everything a running coordinator has loaded
    from fusion.coordinator.outputs import JobOutputs
    out = JobOutputs(sys.argv[1])
    out.write_loss_plot([0, 1, 2, 3], [4.0, 3.0, 2.5, 2.2], "probe (job-1)", records=[{"event": "replanned"}])
    print(json.dumps({
        "modules": sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"),
        "mapped": "matplotlib" in Path("/proc/self/maps").read_text() if sys.platform == "linux" else False,
    }))
""")


def test_loss_png_is_drawn_without_the_coordinator_importing_matplotlib(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "job")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"modules": [], "mapped": False}
    assert (tmp_path / "job" / LOSS_PLOT_FILE).read_bytes()[:8] == PNG_MAGIC


def test_a_plotting_process_that_cannot_run_costs_the_plot_not_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    outputs = JobOutputs(tmp_path / "job")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.WARNING, logger="fusion.coordinator.outputs"):
        outputs.write_loss_plot([0, 1], [2.0, 1.0], "broken")
    outputs.close()
    assert sorted(p.name for p in outputs.dir.iterdir()) == [METRICS_FILE]  # no plot, no temporary file left
    assert "loss.png not drawn" in caplog.text and "could not start" in caplog.text
