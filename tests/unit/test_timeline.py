"""``python -m testbeds.bench.timeline``: a trace lined up per step and per link, on a trace
written by hand (two stages, two micro-batches) whose every figure is known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbeds.bench.timeline import (
    load_events,
    main,
    pick_job,
    step_timelines,
    summarize,
    transfers,
)

ACT, GRAD = 1, 2


def _write(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _step(job: str, step: int, t0: float) -> tuple[list[dict], list[dict]]:
    """(driver and stage 0's events, stage 1's) of one step starting at ``t0`` (ms below)."""

    def ev(ms: float, name: str, stage: int, **kw: object) -> dict:
        return {"t": t0 + ms / 1e3, "ev": name, "job": job, "step": step, "stage": stage, **kw}

    a = [
        ev(0, "step", -1),
        ev(2, "start", 0),
        ev(4, "run_step", -1),
        ev(5, "F0", 0, mb=0),
        ev(15, "F1", 0, mb=0),
        ev(15, "send", 0, kind=ACT, mb=0, dst=1),
        ev(16, "F0", 0, mb=1),
        ev(26, "answered", 0, kind=ACT, mb=0, dst=1),  # mb 0: 15 -> arrives 22 -> answered 26
        ev(30, "F1", 0, mb=1),
        ev(30, "send", 0, kind=ACT, mb=1, dst=1),
        ev(40, "answered", 0, kind=ACT, mb=1, dst=1),  # mb 1: leaves 30, arrives 35
        ev(60, "arrive", 0, kind=GRAD, mb=0, src=1),
        ev(60, "B0", 0, mb=0),
        ev(70, "B1", 0, mb=0),
        ev(80, "arrive", 0, kind=GRAD, mb=1, src=1),
        ev(80, "B0", 0, mb=1),
        ev(90, "B1", 0, mb=1),
        ev(91, "done", 0),
        ev(95, "forward_backward", -1),
        ev(100, "applied", -1),
    ]
    b = [
        ev(3, "start", 1),
        ev(8, "arrive", 1, kind=3, mb=0, src=-1),
        ev(22, "arrive", 1, kind=ACT, mb=0, src=0),
        ev(22, "F0", 1, mb=0),
        ev(32, "F1", 1, mb=0),
        ev(35, "arrive", 1, kind=ACT, mb=1, src=0),
        ev(40, "B0", 1, mb=0),
        ev(50, "B1", 1, mb=0),
        ev(50, "send", 1, kind=GRAD, mb=0, dst=0),
        ev(51, "F0", 1, mb=1),
        ev(61, "F1", 1, mb=1),
        ev(62, "answered", 1, kind=GRAD, mb=0, dst=0),
        ev(62, "B0", 1, mb=1),
        ev(72, "B1", 1, mb=1),
        ev(72, "send", 1, kind=GRAD, mb=1, dst=0),
        ev(84, "answered", 1, kind=GRAD, mb=1, dst=0),
        ev(85, "done", 1),
    ]
    return a, b


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    a, b = [], []
    for step in range(3):
        x, y = _step("job-1", step, 1000.0 + step)
        a += x
        b += y
    # A calibration job on one stage with more steps must not be picked by default.
    for step in range(5):
        a += [
            {"t": 10.0 + step, "ev": "step", "job": "calib", "step": step, "stage": -1},
            {"t": 10.1 + step, "ev": "applied", "job": "calib", "step": step, "stage": -1},
        ]
    _write(tmp_path / "trace-1.jsonl", a)
    _write(tmp_path / "trace-2.jsonl", b)
    with open(tmp_path / "trace-2.jsonl", "a") as f:
        f.write('{"t": 5, "ev": "F0", "sta')  # cut off by a killed process
    return tmp_path


def test_events_are_read_in_time_order_and_a_cut_line_is_counted(trace_dir: Path) -> None:
    events, bad = load_events(trace_dir)
    assert bad == 1
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)


def test_the_job_over_most_stages_is_picked_not_the_one_with_most_steps(trace_dir: Path) -> None:
    events, _ = load_events(trace_dir)
    assert pick_job(events) == "job-1"
    assert pick_job(events, "calib") == "calib"
    with pytest.raises(Exception, match="finished no traced step"):
        pick_job(events, "nope")


def test_a_step_is_lined_up_from_the_drivers_start(trace_dir: Path) -> None:
    events, _ = load_events(trace_dir)
    steps = step_timelines(events, "job-1")
    assert [s.step for s in steps] == [0, 1, 2]
    s = steps[1]
    assert s.step_s == pytest.approx(0.100)
    assert s.run_step_s == pytest.approx(0.004)
    assert s.forward_backward_s == pytest.approx(0.095)
    assert s.done_s == pytest.approx({0: 0.091, 1: 0.085})
    assert s.compute_s == pytest.approx({0: 0.044, 1: 0.040})
    assert s.fed_s == pytest.approx({1: 0.008})  # the target; stage 0's own input is not traced here


def test_a_transfer_leaves_once_the_one_before_it_on_the_pair_is_answered(trace_dir: Path) -> None:
    events, _ = load_events(trace_dir)
    found = {(x.step, x.src, x.micro_batch): x for x in transfers(events, "job-1")}
    assert len(found) == 12  # 3 steps x 2 micro-batches x both directions
    first, second = found[(0, 0, 0)], found[(0, 0, 1)]
    assert first.first and not second.first
    assert first.one_way_s == pytest.approx(0.007) and first.answer_s == pytest.approx(0.011)
    assert first.sender_computing  # stage 0 computed micro-batch 1's forward from 16 to 30 ms
    assert second.one_way_s == pytest.approx(0.005) and not second.sender_computing
    grad1 = found[(0, 1, 1)]  # handed over at 72 ms, the pair free since 62
    assert grad1.start == pytest.approx(grad1.sent)
    assert grad1.one_way_s == pytest.approx(0.008)


def test_the_summary_skips_warm_up_steps_and_groups_links(trace_dir: Path) -> None:
    doc = summarize(trace_dir, skip=1)
    assert [s["step"] for s in doc["steps"]] == [1, 2]
    assert doc["median_step_ms"] == pytest.approx(100.0)
    links = {(r["src"], r["dst"]): r for r in doc["links"]}
    assert set(links) == {(0, 1), (1, 0)}
    forward = links[(0, 1)]
    assert forward["first"] == {"n": 2, "one_way_ms": 7.0, "answer_ms": 11.0}
    assert forward["rest"]["n"] == 2 and forward["rest"]["one_way_ms"] == 5.0
    assert forward["rest_sender_computing"]["n"] == 0


def test_the_command_writes_tables_and_refuses_an_empty_directory(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "timeline"
    assert main([str(trace_dir), "--skip", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 0 -> 1 | 7.0 / 11.0 (2) |" in text
    assert json.loads(out.with_suffix(".json").read_text())["job"] == "job-1"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "no trace files" in capsys.readouterr().err
    assert main([str(trace_dir), "--skip", "9"]) == 2
    assert main([str(trace_dir), "--skip", "-1"]) == 2
