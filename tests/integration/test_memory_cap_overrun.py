"""A stage whose real peak outgrows its worker's cap during a step: the step fails, the job re-plans.

Real ``fusion-coordinator`` and ``fusion-worker --memory-gb --allow-code`` processes on
loopback. The job owner's model routes the rows whose first feature is positive through a
deep expert (a one-expert mixture, as MoE layers route tokens): how much it keeps for
backward depends on the data. The profiler never sees data — workers profile on zeros
shaped like the inputs, which route no row — so the planner's estimate of that block's
activations is a few bytes, and the whole model (2.9 MB predicted, 3.7 MB real) is planned
onto one worker lending 3.3 MB. Its first step peaks over the cap, and must fail naming the
worker, the stage and the bytes; the coordinator then re-plans with the peak it measured,
over both workers, and the job ends with every stage's measured peak within its cap and the
losses of an uninterrupted run.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet
from fusion.memory import gb_to_bytes
from fusion.training import train_reference
from tests.integration.test_memory_cap import wait_end

pytestmark = pytest.mark.timeout(300)

TOKEN = "memory-overrun-token"
CAP_GB = 0.00307  # 3.30 MB: over the model's predicted peak, under its real one
CAP_BYTES = gb_to_bytes(CAP_GB)

OWNER_MODEL = """
import torch
from torch import nn


class Routed(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.mix = nn.Linear(width, width)

    def forward(self, x):  # (B, width)
        mask = x[:, 0] > 0
        h = x[mask]  # (rows routed, width): as many as the data says
        for _ in range(self.depth):
            h = torch.tanh(self.mix(h))
        return x + torch.zeros_like(x).index_put((mask,), h)


def build(width: int = 192, depth: int = 24, hidden: int = 256, num_classes: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), Routed(width, depth), nn.Linear(width, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
    )
"""


@pytest.fixture
def owner_code(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "owner"
    d.mkdir()
    (d / "routed_expert.py").write_text(OWNER_MODEL)
    sys.path.insert(0, str(d))  # the reference run builds the model here too
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("routed_expert", None)


def job_file(path: Path, out: Path) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "memory-overrun"
        [model]
        name = "routed_expert:build"
        leaf_modules = ["1"]
        [data]
        name = "shapes"
        batch_size = 128
        image_size = 8
        num_classes = 4
        num_samples = 1024
        [train]
        steps = 4
        micro_batches = 1
        optimizer = "adamw"
        lr = 0.001
        seed = 3
        [cluster]
        min_workers = 2
        [plan]
        strategy = "opfence"
        [output]
        dir = "{out}"
    """)
    )
    return path


def test_a_stage_over_its_cap_fails_the_step_and_the_job_replans_with_the_measured_peak(
    owner_code: Path, tmp_path: Path
) -> None:
    with Fleet(tmp_path / "logs", extra_pythonpath=[str(owner_code)]) as fleet:
        fleet.start_coordinator(
            token=TOKEN, state_dir=tmp_path / "state", heartbeat_interval_s=0.5, heartbeat_timeout_s=6.0
        )
        for name in ("w0", "w1"):
            fleet.start_worker(name, token=TOKEN, allow_code=True, wait=False, extra_args=["--memory-gb", str(CAP_GB)])
        fleet.wait_workers(["w0", "w1"])
        path = job_file(tmp_path / "job.toml", tmp_path / "out")
        with CoordinatorClient(fleet.coordinator_address, TOKEN) as client:
            s = wait_end(client, client.submit(load_job(path)), timeout_s=240.0)
        assert s["state"] == "succeeded", s
        out = Path(s["output_dir"])
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        events = [r for r in records if "event" in r]
        exceeded = [e for e in events if e["event"] == "memory_exceeded"]
        assert exceeded, [e["event"] for e in events]
        first = exceeded[0]
        print(first["message"])
        # The step's error names the worker, the stage and the bytes.
        assert first["cap_bytes"] == CAP_BYTES < first["measured_peak_bytes"], first
        assert f"worker {first['worker']} cannot hold stage {first['stage']}" in first["message"], first
        assert f"its step peaked at {first['measured_peak_bytes']} bytes" in first["message"], first
        # Re-planned with the measured peak: over both workers, each stage within its cap.
        memory = json.loads((out / "measured.json").read_text())["memory"]
        print(json.dumps(memory, indent=1))
        assert memory["scale"] > 1.0 and memory["exceeded"], memory
        assert len(memory["stages"]) == 2, memory
        for st in memory["stages"]:
            assert 0 < st["measured_peak_bytes"] <= st["cap_bytes"] == CAP_BYTES, st
        # The failed step was redone: the losses are those of an uninterrupted run.
        losses = {r["step"]: r["loss"] for r in records if "event" not in r}
        ref = train_reference(load_job(path))
        torch.testing.assert_close(
            torch.tensor([losses[i] for i in range(4)]), torch.tensor(ref.losses), rtol=1e-4, atol=1e-5
        )
