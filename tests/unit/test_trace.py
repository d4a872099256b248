"""The executor's timeline tracer (:mod:`executor.trace`): off unless asked, one JSON line
per event when on, and never a reason for a training run to stop."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from executor import trace
from executor.trace import TRACE_DIR_ENV, Tracer, use_tracer


def test_an_off_tracer_writes_nothing(tmp_path: Path) -> None:
    t = Tracer(None)
    assert not t.enabled and t.path is None
    t.event("F0", stage=0)
    assert list(tmp_path.iterdir()) == []


def test_an_on_tracer_appends_one_json_line_per_event(tmp_path: Path) -> None:
    t = Tracer(tmp_path / "deeper")
    assert t.enabled and t.path == tmp_path / "deeper" / f"trace-{os.getpid()}.jsonl"
    t.event("send", job="j", stage=1, step=3, kind=1, mb=0, dst=2)
    t.event("answered", job="j", stage=1, step=3, kind=1, mb=0, dst=2)
    lines = [json.loads(x) for x in t.path.read_text().splitlines()]
    assert [x["ev"] for x in lines] == ["send", "answered"]
    assert lines[0]["dst"] == 2 and lines[0]["step"] == 3 and lines[0]["job"] == "j"
    assert lines[0]["t"] <= lines[1]["t"]


def test_a_directory_that_cannot_be_made_turns_tracing_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="executor.trace"):
        t = Tracer(blocker / "trace")
    assert not t.enabled
    assert "tracing off" in caplog.text
    t.event("F0")  # still safe to call


def test_a_failed_write_turns_tracing_off_and_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = Tracer(tmp_path)
    assert t._file is not None
    t._file.close()  # as if the disk went away
    with caplog.at_level(logging.WARNING, logger="executor.trace"):
        t.event("F0", stage=0)
    assert not t.enabled
    assert "writing" in caplog.text


def test_the_process_tracer_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "_tracer", None)
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    assert trace.tracer().enabled and trace.tracer() is trace.tracer()
    monkeypatch.setattr(trace, "_tracer", None)
    monkeypatch.delenv(TRACE_DIR_ENV)
    assert not trace.tracer().enabled


def test_use_tracer_swaps_and_returns_the_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "_tracer", None)
    on = Tracer(tmp_path)
    previous = use_tracer(on)
    assert not previous.enabled
    assert trace.tracer() is on
    assert use_tracer(previous) is on
