"""A traced run of real executor processes: the timeline lines up every step and every
transfer between the stages, and tracing changes nothing the run computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor import trace
from executor.trace import TRACE_DIR_ENV, Tracer, use_tracer
from fusion.config import JobSpec
from fusion.launch.executors import LocalCluster
from testbeds.bench.timeline import load_events, pick_job, summarize, transfers
from tests.support.parity import assert_parity

JOB = JobSpec.from_dict(
    {
        "model": {"name": "gpt2", "preset": "tiny"},
        "data": {"batch_size": 8, "seq_len": 16},
        "train": {"steps": 2, "micro_batches": 2, "optimizer": "adamw", "lr": 1e-3},
    }
)


def test_a_traced_two_stage_run_matches_pytorch_and_its_timeline_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))  # the workers inherit it
    previous = use_tracer(Tracer(tmp_path))  # this process drives
    try:
        with LocalCluster(2, torch_threads=1) as cluster:
            assert_parity(JOB, cluster.addresses, steps=2)
    finally:
        use_tracer(previous)
    monkeypatch.setattr(trace, "_tracer", previous)
    files = sorted(tmp_path.glob("trace-*.jsonl"))
    assert len(files) == 3, files  # the driver and two workers
    events, bad = load_events(tmp_path)
    assert bad == 0
    job = pick_job(events)
    doc = summarize(tmp_path, job=job)
    assert [s["step"] for s in doc["steps"]] == [0, 1]
    for s in doc["steps"]:
        assert set(s["done_ms"]) == {"0", "1"} and set(s["compute_ms"]) == {"0", "1"}
        assert all(v > 0 for v in s["compute_ms"].values())
        # Every RunStep answer comes before the driver waits for the stages to finish, but a
        # stage of this tiny job may finish before the last answer reaches the driver.
        assert 0 < s["run_step_ms"] <= s["forward_backward_ms"]
        assert max(s["done_ms"].values()) <= s["forward_backward_ms"] < s["step_ms"]
    found = transfers(events, job)
    # Per step and micro-batch: activations 0 -> 1 and their gradients 1 -> 0.
    assert sorted((x.step, x.src, x.dst, x.micro_batch) for x in found) == sorted(
        (step, src, 1 - src, mb) for step in (0, 1) for src in (0, 1) for mb in (0, 1)
    )
    assert all(x.sent <= x.start < x.arrived <= x.answered for x in found)
    # Every step of a stage runs on its one compute thread: a fresh thread per step paid
    # torch's first-call cost (~13 ms for a ResNet) at the start of every step.
    threads = {(e["stage"], e["thread"]) for e in events if e.get("job") == job and e["ev"] == "start"}
    assert sorted(threads) == [(0, "stage0-compute"), (1, "stage1-compute")], threads
