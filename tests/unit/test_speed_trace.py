"""The machine-speed trace (``testbeds.speed_trace``) on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusion.config import JobSpec
from testbeds import speed_trace

GPT2_TINY = """
name = "trace-gpt2-tiny"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 8
seq_len = 16
[train]
steps = 1
micro_batches = 2
"""


def test_trace_reports_each_window_against_the_median() -> None:
    doc = speed_trace.trace(JobSpec.from_toml(GPT2_TINY), seconds=0.4, window_s=0.1)
    assert 1 <= len(doc["windows"]) <= 4
    assert [w["start_s"] for w in doc["windows"]] == sorted(w["start_s"] for w in doc["windows"])
    for w in doc["windows"]:
        assert w["steps"] > 0 and w["median_step_s"] > 0
        assert w["relative"] == pytest.approx(w["median_step_s"] / doc["median_step_s"])
    assert doc["slowest_over_fastest_window"] >= 1.0
    assert 0.0 <= doc["share_of_windows_over_1_25x_the_fastest"] < 1.0


def test_cli_writes_both_files_and_rejects_a_window_longer_than_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.toml"
    job.write_text(GPT2_TINY)
    out = tmp_path / "trace"
    assert speed_trace.main(["--job", str(job), "--seconds", "0.2", "--window", "0.1", "--out", str(out)]) == 0
    assert json.loads(Path(f"{out}.json").read_text())["windows"]
    assert "| window start s |" in Path(f"{out}.md").read_text()
    with pytest.raises(SystemExit):
        speed_trace.main(["--job", str(job), "--seconds", "1", "--window", "2"])
    assert "window no longer than the trace" in capsys.readouterr().err
