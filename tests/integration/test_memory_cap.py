"""Volunteers cap the memory they lend: real ``fusion-worker --memory-gb`` processes.

A GPT-2 small enough to train in seconds but whose parameters, gradients and AdamW state
(12.7 MiB) no single worker here holds: each lends 6.66 MiB (``--memory-gb 0.0065``), so
the job must be split over three of them. Checked: the coordinator reports what each worker
lends; the plan keeps every stage within its worker's cap and ``measured.json`` records the
peaks the stages measured against the caps; a job that needs more than the workers lend is
refused with the memory needed and lent; and a job that loses a worker it cannot do without
(killed, or leaving with Ctrl-C) waits, ``pending`` and saying what it needs and has, until a
worker with enough memory joins, then finishes with the losses and parameters of an
uninterrupted run.
"""

from __future__ import annotations

import json
import signal
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from fusion.memory import gb_to_bytes
from fusion.training import build_job_model, train_reference
from tests.support.parity import assert_recorded_losses

pytestmark = pytest.mark.timeout(420)

TOKEN = "memory-cap-token"
CAP_GB = 0.0065
CAP_BYTES = gb_to_bytes(CAP_GB)
TERMINAL = ("succeeded", "failed", "cancelled")


def job_file(path: Path, out: Path, *, n_embd: int = 128, steps: int = 16, workers: int = 3) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "memory-cap"
        [model]
        name = "gpt2"
        preset = "tiny"
        n_embd = {n_embd}
        n_layer = 4
        n_head = 4
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = {steps}
        micro_batches = 2
        optimizer = "adamw"
        lr = 0.001
        seed = 7
        [cluster]
        min_workers = {workers}
        [plan]
        strategy = "opfence"
        [checkpoint]
        replicate_every = 2
        durable_every = 4
        keep = 2
        [output]
        dir = "{out}"
    """)
    )
    return path


@pytest.fixture
def fleet_of(tmp_path: Path) -> Iterator[Callable[[int], Fleet]]:
    fleets: list[Fleet] = []

    def start(n: int) -> Fleet:
        f = Fleet(tmp_path / "logs")
        fleets.append(f)
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=4.0
        )
        for i in range(n):
            f.start_worker(f"w{i}", token=TOKEN, wait=False, extra_args=["--memory-gb", str(CAP_GB)])
        f.wait_workers([f"w{i}" for i in range(n)])
        return f

    yield start
    for f in fleets:
        f.close()


def check_same_run(s: dict[str, Any], path: Path) -> None:
    """Every step's loss equals an uninterrupted single-process run's, and so do the final
    parameters, to a tolerance that AdamW's normalisation of near-zero gradients needs at
    this width (a split run's last-bit differences there grow to ~2e-5 in a few elements)."""
    out = Path(s["output_dir"])
    spec = load_job(path)
    ref = train_reference(spec)
    assert_recorded_losses(out / "metrics.jsonl", ref.losses)
    model = build_job_model(spec)
    model.load_state_dict(load_file(out / "model.safetensors"))
    for name, v in ref.state_dict.items():
        torch.testing.assert_close(model.state_dict()[name], v, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def wait_until(client: CoordinatorClient, job_id: str, done: Callable[[dict[str, Any]], bool], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = client.status(job_id)
        if done(s):
            return s
        if s["state"] in TERMINAL:
            raise AssertionError(f"job ended: {s}")
        time.sleep(0.1)
    raise AssertionError(f"timed out: {client.status(job_id)}")


def wait_end(client: CoordinatorClient, job_id: str, timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = client.status(job_id)
        if s["state"] in TERMINAL:
            return s
        time.sleep(0.2)
    raise AssertionError(f"job did not end: {client.status(job_id)}")


def test_workers_report_their_cap_and_jobs_are_planned_within_it(
    fleet_of: Callable[[int], Fleet], tmp_path: Path
) -> None:
    fleet = fleet_of(3)
    with CoordinatorClient(fleet.coordinator_address, TOKEN) as client:
        workers = client.workers()
        assert sorted(w.name for w in workers) == ["w0", "w1", "w2"]
        for w in workers:
            assert w.resources.device_memory_bytes == CAP_BYTES, w
            assert w.resources.memory_bytes == CAP_BYTES, w
        assert "lending 6.66 MiB of memory" in fleet.log_of("worker-w0")

        path = job_file(tmp_path / "job.toml", tmp_path / "out", steps=6)
        job_id = client.submit(load_job(path))
        s = wait_end(client, job_id)
        assert s["state"] == "succeeded", s
        out = Path(s["output_dir"])
        plan = json.loads((out / "plan.json").read_text())
        assert len(plan["stages"]) >= 2, plan["stages"]  # no one worker holds the model
        assert all(0 < st["peak_memory_bytes"] <= CAP_BYTES for st in plan["stages"]), plan["stages"]
        memory = json.loads((out / "measured.json").read_text())["memory"]
        print(json.dumps(memory["stages"], indent=1))
        assert len(memory["stages"]) == len(plan["stages"])
        for st in memory["stages"]:
            assert st["cap_bytes"] == CAP_BYTES
            assert 0 < st["measured_peak_bytes"] <= CAP_BYTES, st
        assert memory["exceeded"] == [] and memory["scale"] == 1.0

        # Four times the parameters: no split over 3 x 6.66 MiB holds them.
        big = job_file(tmp_path / "big.toml", tmp_path / "out", n_embd=256, steps=2)
        big_id = client.submit(load_job(big))
        s = wait_end(client, big_id)
        assert s["state"] == "failed", s
        print(s["reason"])
        assert "cannot fit" in s["reason"] and "lent: 3 workers lend 19.97 MiB" in s["reason"], s["reason"]


def test_a_job_that_loses_memory_waits_pending_and_resumes_when_memory_joins(
    fleet_of: Callable[[int], Fleet], tmp_path: Path
) -> None:
    """Memory is lost twice: a stage worker is killed, then the worker that replaced it
    leaves with Ctrl-C (SIGINT, the graceful leave). Each time the job waits until a worker
    lending more joins; the leaver is not held up by the wait and nothing it held is redone."""
    fleet = fleet_of(3)
    path = job_file(tmp_path / "job.toml", tmp_path / "out", steps=30)  # steps 12-30 outlast the Ctrl-C below
    with CoordinatorClient(fleet.coordinator_address, TOKEN) as client:
        job_id = client.submit(load_job(path))
        s = wait_until(client, job_id, lambda s: s["state"] == "running" and s["step"] >= 6, 240.0)
        stage_workers = [st["worker"] for st in s["plan"]["stages"]]
        assert len(stage_workers) >= 2, s["plan"]
        victim = stage_workers[-1]
        fleet.workers[victim].kill()

        # Two workers lend 13.31 MiB: the model's state alone is 12.73 MiB, its activations more.
        s = wait_until(client, job_id, lambda s: s["state"] == "pending" and bool(s.get("waiting")), 120.0)
        print(f"waiting: {s['waiting']}")
        assert s["waiting"].startswith("needs ") and "has 13.31 MiB (2 workers)" in s["waiting"], s["waiting"]
        time.sleep(2.0)  # it keeps waiting: nothing fails while no memory joins
        assert client.status(job_id)["state"] == "pending"

        fleet.start_worker("big", token=TOKEN, extra_args=["--memory-gb", "0.05"])
        s = wait_until(client, job_id, lambda s: s["state"] == "running" and "big" in s["workers"], 120.0)
        left_at = wait_until(client, job_id, lambda s: s["step"] >= 12, 120.0)["step"]
        leaver = fleet.workers["big"]
        leaver.send_signal(signal.SIGINT)
        # The leave is not held up by the wait: the state is handed off, then the worker goes.
        assert leaver.wait(timeout=60) == 0, fleet.log_of("worker-big")
        s = wait_until(client, job_id, lambda s: s["state"] == "pending" and bool(s.get("waiting")), 60.0)
        assert "has 13.31 MiB (2 workers)" in s["waiting"], s["waiting"]

        fleet.start_worker("big2", token=TOKEN, extra_args=["--memory-gb", "0.05"])
        s = wait_end(client, job_id)
        assert s["state"] == "succeeded", s
        assert s.get("waiting") is None
        events = [r for r in map(json.loads, (Path(s["output_dir"]) / "metrics.jsonl").read_text().splitlines())]
        events = [r for r in events if "event" in r]
        kinds = [e["event"] for e in events]
        assert kinds.count("waiting_for_workers") == 2 and "worker_leaving" in kinds, kinds
        replanned = [e for e in events if e["event"] == "replanned"]
        assert "big" in replanned[-2]["stages"] and victim not in replanned[-2]["stages"], replanned
        assert "big2" in replanned[-1]["stages"] and "big" not in replanned[-1]["stages"], replanned
        # After the leave, nothing was redone: the job resumed at the step it was handed off at.
        resumed = [e for e in events if e["event"] == "resumed_at_step"][-1]
        assert resumed["step"] >= left_at and "nothing redone" in resumed["message"], resumed
    check_same_run(s, path)
