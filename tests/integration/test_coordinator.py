"""The user-facing system end to end: real processes, real gRPC, a real SQLite file.

A ``fusion-coordinator`` and three ``fusion-worker`` processes are started as separate OS
processes; jobs go in through ``fusion submit`` and are watched with
``fusion status --json``, exactly as a job owner would.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fusion.config import load_job
from fusion.launch import Fleet, child_env
from fusion.training import build_job_model, train_reference
from scheduler.topology import Topology
from tests.support.parity import assert_state_close

TOKEN = "test-token-123"

USER_MODEL = """
import torch.nn as nn


class TinyMLP(nn.Module):
    def __init__(self, hidden: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 8 * 8, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


def make(hidden: int = 16, num_classes: int = 4) -> nn.Module:
    return TinyMLP(hidden, num_classes)
"""


class Cli:
    """Runs ``fusion`` commands against one coordinator."""

    def __init__(self, address: str, token: str, env: dict[str, str]) -> None:
        self.env = {**env, "FUSION_COORDINATOR": address, "FUSION_TOKEN": token}

    def run(self, *args: str, timeout: float = 120, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        if token is not None:
            env["FUSION_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-m", "fusion.cli.main", *args], env=env, capture_output=True, text=True, timeout=timeout
        )

    def submit(self, job_file: Path) -> str:
        r = self.run("submit", str(job_file))
        assert r.returncode == 0, r.stderr
        return r.stdout.split()[-1]

    def status(self, job_id: str) -> dict[str, Any]:
        r = self.run("status", job_id, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def wait(
        self, job_id: str, states: tuple[str, ...] = ("succeeded", "failed", "cancelled"), timeout: float = 240
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status(job_id)
            if s["state"] in states:
                return s
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {self.status(job_id)}")


@pytest.fixture(scope="module")
def user_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model module outside the package, on the PYTHONPATH of every process."""
    d = tmp_path_factory.mktemp("user_code")
    (d / "my_models.py").write_text(USER_MODEL)
    return d


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, user_code: Path) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    with Fleet(base / "logs", extra_pythonpath=[str(user_code)]) as f:
        f.start_coordinator(token=TOKEN, state_dir=base / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)
        for i in range(3):
            f.start_worker(f"w{i}", token=TOKEN, allow_code=True, wait=False)
        f.wait_workers([f"w{i}" for i in range(3)])
        yield f


@pytest.fixture(scope="module")
def cli(fleet: Fleet, user_code: Path) -> Cli:
    return Cli(fleet.coordinator_address, TOKEN, child_env([str(user_code)]))


def write_job(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def check_outputs(job_dir: Path, job_file: Path, steps: int) -> None:
    """Outputs exist, the loss fell, the model loads and equals single-process training."""
    for name in ("model.safetensors", "metrics.jsonl", "loss.png", "plan.json", "summary.json"):
        assert (job_dir / name).exists(), name
    metrics = [m for m in map(json.loads, (job_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in m]
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all("bytes_per_link" in m and "samples_per_s" in m for m in metrics)
    losses = [m["loss"] for m in metrics]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    assert (job_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = json.loads((job_dir / "plan.json").read_text())
    assert {"strategy", "predicted_step_s", "planning_s", "stages", "cuts"} <= set(plan)
    spec = load_job(job_file)
    model = build_job_model(spec)
    model.load_state_dict(load_file(job_dir / "model.safetensors"))
    ref = train_reference(spec)
    assert_state_close(model.state_dict(), ref.state_dict)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-4, atol=1e-5)


def test_gpt2_job_trains_like_one_process(cli: Cli, tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "gpt2.toml",
        f"""
        name = "gpt2-it"
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 8
        seq_len = 32
        shuffle = false
        [train]
        steps = 12
        micro_batches = 2
        optimizer = "sgd"
        lr = 0.5
        [cluster]
        min_workers = 3
        [plan]
        strategy = "uniform"
        [output]
        dir = "{tmp_path / "out"}"
    """,
    )
    job_id = cli.submit(job)
    s = cli.wait(job_id)
    assert s["state"] == "succeeded", s
    assert {"id", "state", "step", "steps", "loss", "workers", "events"} <= set(s)
    assert s["step"] == s["steps"] == 12 and len(s["workers"]) == 3
    check_outputs(Path(s["output_dir"]), job, 12)
    listed = cli.run("jobs", "--json")
    assert job_id in {j["id"] for j in json.loads(listed.stdout)}
    logs = cli.run("logs", job_id)
    assert "step 12:" in logs.stdout and "step 0:" not in logs.stdout and "succeeded" in logs.stdout  # steps done


def test_opfence_job_trains_like_one_process(cli: Cli, tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "opfence.toml",
        f"""
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 8
        seq_len = 32
        [train]
        steps = 8
        micro_batches = 4
        optimizer = "adamw"
        lr = 3e-3
        [plan]
        strategy = "opfence"
        [output]
        dir = "{tmp_path / "out"}"
    """,
    )
    job_id = cli.submit(job)
    s = cli.wait(job_id)
    assert s["state"] == "succeeded", s
    job_dir = Path(s["output_dir"])
    check_outputs(job_dir, job, 8)
    plan = json.loads((job_dir / "plan.json").read_text())
    assert plan["strategy"] == "opfence" and plan["predicted_step_s"] > 0
    # Every worker here reports this machine's boot id: a pipeline over them would only add
    # transfers to the same cores, so OP-Fence keeps the model whole.
    assert len(plan["stages"]) == 1, plan["stages"]
    measured = json.loads((job_dir / "measured.json").read_text())
    topology = Topology.from_dict(measured["topology"])  # what the plan was made from
    assert len(set(topology.machine_of)) == 1 and topology.driver_links is not None, measured
    assert plan["stages"][0]["worker"] in topology.names() and measured["compute_factor"] > 0, measured
    assert all(st["compute_s"] is not None and st["peak_memory_bytes"] > 0 for st in plan["stages"])
    metrics = [m for m in map(json.loads, (job_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in m]
    assert all("predicted_step_s" in m for m in metrics)
    events = " ".join(e["message"] for e in s["events"])
    assert "measured" in events or "profiled" in events


def test_resnet_job_trains_like_one_process(cli: Cli, tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "resnet.toml",
        f"""
        [model]
        name = "resnet"
        preset = "tiny"
        num_classes = 4
        [data]
        batch_size = 16
        image_size = 16
        num_classes = 4
        num_samples = 256
        [train]
        steps = 10
        optimizer = "sgd"
        lr = 0.1
        [output]
        dir = "{tmp_path / "out"}"
    """,
    )
    job_id = cli.submit(job)
    s = cli.wait(job_id)
    assert s["state"] == "succeeded", s
    check_outputs(Path(s["output_dir"]), job, 10)


def test_user_factory_model_from_outside_the_package(
    cli: Cli, tmp_path: Path, user_code: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(user_code))  # for the single-process reference here
    job = write_job(
        tmp_path / "user.toml",
        f"""
        [model]
        name = "my_models:make"
        hidden = 24
        [data]
        name = "shapes"
        batch_size = 16
        image_size = 8
        num_classes = 4
        num_samples = 256
        [train]
        steps = 10
        optimizer = "sgd"
        lr = 0.2
        [output]
        dir = "{tmp_path / "out"}"
    """,
    )
    job_id = cli.submit(job)
    s = cli.wait(job_id)
    assert s["state"] == "succeeded", s
    check_outputs(Path(s["output_dir"]), job, 10)


def test_bad_job_files_are_rejected_at_submit(cli: Cli, tmp_path: Path) -> None:
    cases = {
        "syntax.toml": ("[model\nname = 'gpt2'", "invalid TOML"),
        "unknown-key.toml": ("[model]\nname = 'gpt2'\npreset = 'tiny'\n[train]\nstep = 3\n", "train.step"),
        "no-model.toml": ("[train]\nsteps = 3\n", "model.name"),
        "bad-value.toml": ("[model]\nname = 'gpt2'\npreset = 'tiny'\n[train]\nlr = -1.0\n", "train.lr"),
        "bad-preset.toml": ("[model]\nname = 'gpt2'\npreset = 'huge'\n", "preset"),
        "bad-option.toml": ("[model]\nname = 'gpt2'\npreset = 'tiny'\nn_layers = 3\n", "n_layers"),
        "bad-batch.toml": (
            "[model]\nname = 'gpt2'\npreset = 'tiny'\n[data]\nbatch_size = 6\n[train]\nmicro_batches = 4\n",
            "data.batch_size",
        ),
    }
    before = len(json.loads(cli.run("jobs", "--json").stdout))
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        r = cli.run("submit", str(path))
        assert r.returncode != 0, (name, r.stdout)
        assert expected in r.stderr, (name, r.stderr)
    assert len(json.loads(cli.run("jobs", "--json").stdout)) == before
    missing = cli.run("submit", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml" in missing.stderr


def test_wrong_token_is_refused(fleet: Fleet, cli: Cli, tmp_path: Path) -> None:
    r = cli.run("jobs", token="not-the-token")
    assert r.returncode == 2 and "wrong or missing token" in r.stderr  # bad input, as for fusion-worker
    proc = fleet.start_worker("intruder", token="not-the-token", wait=False)
    assert proc.wait(timeout=60) == 2
    assert "refused" in fleet.log_of("worker-intruder")


def test_job_waits_for_workers_then_runs(fleet: Fleet, cli: Cli, tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "four.toml",
        f"""
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = 3
        [cluster]
        min_workers = 4
        [plan]
        strategy = "uniform"
        [output]
        dir = "{tmp_path / "out"}"
    """,
    )
    job_id = cli.submit(job)
    time.sleep(3)
    assert cli.status(job_id)["state"] == "pending"
    proc = fleet.start_worker("late", token=TOKEN)
    s = cli.wait(job_id)
    assert s["state"] == "succeeded", s
    assert "late" in s["workers"]
    # Ctrl-C: the worker deregisters and exits cleanly.
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    workers = json.loads(cli.run("status", "--json").stdout)["workers"]
    assert {w["name"]: w["state"] for w in workers}["late"] == "gone"


def _signal_thread(pid: int, tid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to one thread of another process (``tgkill``), as the kernel may deliver a
    signal sent to the process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig.name}) failed")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and tgkill (Linux)")
def test_ctrl_c_received_by_another_thread_still_lets_the_worker_leave(fleet: Fleet, cli: Cli) -> None:
    """CPython runs a signal handler in the main thread only; a Ctrl-C that the kernel hands
    to one of the worker's other threads (gRPC's, torch's) was lost while the main thread
    waited, and the volunteer's worker never left (:mod:`fusion.stop_signals`)."""
    proc = fleet.start_worker("sidethread", token=TOKEN)
    others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
    assert others, "the worker runs threads beside its main one"
    _signal_thread(proc.pid, others[-1], signal.SIGINT)
    assert proc.wait(timeout=30) == 0, fleet.log_of("worker-sidethread")
    workers = json.loads(cli.run("status", "--json").stdout)["workers"]
    assert {w["name"]: w["state"] for w in workers}["sidethread"] == "gone"


def test_cancel_pending_job(cli: Cli, tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "many.toml",
        f"""
        [model]
        name = "gpt2"
        preset = "tiny"
        [cluster]
        min_workers = 50
        [output]
        dir = "{tmp_path / "out"}"
    """,
    )
    job_id = cli.submit(job)
    r = cli.run("cancel", job_id)
    assert r.returncode == 0 and "cancelled" in r.stdout
    assert cli.status(job_id)["state"] == "cancelled"


# ----------------------------------------------------------------- failures and restarts
@pytest.fixture
def small_fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path / "logs") as f:
        f.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0
        )
        for i in range(2):
            f.start_worker(f"s{i}", token=TOKEN, wait=False)
        f.wait_workers(["s0", "s1"])
        yield f


def long_job(path: Path, out: Path, steps: int) -> Path:
    return write_job(
        path,
        f"""
        [model]
        name = "gpt2"
        preset = "tiny"
        [data]
        batch_size = 4
        seq_len = 16
        [train]
        steps = {steps}
        [cluster]
        min_workers = 2
        [output]
        dir = "{out}"
    """,
    )


def test_killed_worker_is_dropped_and_the_job_goes_on(small_fleet: Fleet, tmp_path: Path) -> None:
    cli = Cli(small_fleet.coordinator_address, TOKEN, child_env())
    job_id = cli.submit(long_job(tmp_path / "long.toml", tmp_path / "out", 100000))
    cli.wait(job_id, states=("running",), timeout=120)
    while cli.status(job_id)["step"] < 2:
        time.sleep(0.2)
    victim = cli.status(job_id)["plan"]["stages"][0]["worker"]
    small_fleet.workers[victim].kill()
    killed_at = time.time()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = cli.status(job_id)
        events = {e["event"]: e for e in s["events"]}
        if "resumed_at_step" in events and s["step"] > events["resumed_at_step"]["step"] + 2:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"job did not resume: {s}")
    print(
        f"resumed {events['resumed_at_step']['time'] - killed_at:.2f}s after the kill: "
        f"{events['resumed_at_step']['message']}"
    )
    assert s["state"] == "running"
    assert victim in events["worker_lost"]["message"]
    assert victim not in [st["worker"] for st in s["plan"]["stages"]]
    r = cli.run("cancel", job_id)
    assert r.returncode == 0 and cli.status(job_id)["state"] == "cancelled"


def test_restarted_coordinator_still_reports_finished_jobs(small_fleet: Fleet, tmp_path: Path) -> None:
    cli = Cli(small_fleet.coordinator_address, TOKEN, child_env())
    job_id = cli.submit(long_job(tmp_path / "short.toml", tmp_path / "out", 3))
    done = cli.wait(job_id)
    assert done["state"] == "succeeded"
    assert small_fleet.coordinator is not None
    assert small_fleet.stop(small_fleet.coordinator) == 0
    port = int(small_fleet.coordinator_address.rsplit(":", 1)[1])
    small_fleet.start_coordinator(token=TOKEN, state_dir=tmp_path / "state", port=port)
    again = cli.status(job_id)
    assert again["state"] == "succeeded" and again["loss"] == pytest.approx(done["loss"])
    # Workers notice the restart and join again.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live = [w for w in json.loads(cli.run("status", "--json").stdout)["workers"] if w["state"] == "idle"]
        if len(live) == 2:
            break
        time.sleep(0.5)
    assert len(live) == 2
    second = cli.submit(long_job(tmp_path / "again.toml", tmp_path / "out", 2))
    assert cli.wait(second)["state"] == "succeeded"
