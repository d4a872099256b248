"""An owner's compression choice holds, on a real coordinator and three real workers on loopback.

Loopback links are never slow, so with ``[compression] cuts = "slow"`` (the default) a
``topk`` job compresses nothing: it must say so in its plan, its events, ``fusion status``
and ``summary.json``. The same job with ``cuts = "all"`` and ``mode = "quant"`` at 4 bits
must put the codec on every cut of the plan, send fewer bytes on each link than the dense
run of the same split, and still learn.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion.config import load_job
from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet, child_env

TOKEN = "compression-cuts-token-0123456789"

pytestmark = pytest.mark.timeout(400)

TINY_MODEL = """
import torch.nn as nn


def make(hidden: int = 64, num_classes: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
"""

NOTE = "compression: mode topk on no cut: no cut is slower than the slowest stage's compute"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp_path = tmp_path_factory.mktemp("cuts")
    code = tmp_path / "code"
    code.mkdir()
    (code / "tiny_models.py").write_text(TINY_MODEL)
    with Fleet(tmp_path / "logs", extra_pythonpath=[str(code)]) as f:
        f.start_coordinator(token=TOKEN, state_dir=tmp_path / "state")
        for name in ("w0", "w1", "w2"):
            f.start_worker(name, token=TOKEN, allow_code=True)
        yield f


def job_file(path: Path, out: Path, compression: str) -> Path:
    path.write_text(
        textwrap.dedent(f"""
        name = "cuts"
        [model]
        name = "tiny_models:make"
        [data]
        name = "shapes"
        batch_size = 16
        image_size = 8
        num_classes = 4
        num_samples = 128
        [train]
        steps = 12
        optimizer = "adamw"
        lr = 0.01
        [cluster]
        min_workers = 3
        [plan]
        strategy = "uniform"
        [output]
        dir = "{out}"
        [compression]
        """)
        + textwrap.dedent(compression)
    )
    return path


def run_job(client: CoordinatorClient, path: Path) -> tuple[str, dict[str, Any]]:
    job_id = client.submit(load_job(path))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        s = client.status(job_id)
        if s["state"] in ("succeeded", "failed", "cancelled"):
            return job_id, s
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish: {client.status(job_id)}")


def bytes_per_link(out: Path) -> dict[str, int]:
    """Bytes each link sent in the job's last step."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "bytes_per_link" in r][-1]["bytes_per_link"]


def test_compressing_no_cut_says_so_and_cuts_all_compresses_every_cut(fleet: Fleet, tmp_path: Path) -> None:
    client = CoordinatorClient(fleet.coordinator_address, TOKEN)
    try:
        job_id, s = run_job(
            client, job_file(tmp_path / "slow.toml", tmp_path / "slow", 'mode = "topk"\nkeep_ratio = 0.1\n')
        )
        assert s["state"] == "succeeded", s
        slow_out = Path(s["output_dir"])
        plan = json.loads((slow_out / "plan.json").read_text())
        assert len(plan["stages"]) == 3 and {c["codec"] for c in plan["cuts"]} == {"none"}, plan["cuts"]
        assert plan["extra"]["compression_note"].startswith(NOTE), plan["extra"]
        assert 'set [compression] cuts = "all" to compress every cut' in plan["extra"]["compression_note"]
        assert s["compression_note"] == plan["extra"]["compression_note"], s
        summary = json.loads((slow_out / "summary.json").read_text())
        assert summary["compression_note"] == plan["extra"]["compression_note"]
        lines, _ = client.logs(job_id)
        assert any(" compression: " + NOTE in line for line in lines), lines

        env = {**child_env([]), "FUSION_COORDINATOR": fleet.coordinator_address, "FUSION_TOKEN": TOKEN}
        text = subprocess.run(
            [sys.executable, "-m", "fusion.cli.main", "status", job_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert text.returncode == 0 and NOTE in text.stdout, (text.stdout, text.stderr)

        job_id, s = run_job(
            client, job_file(tmp_path / "all.toml", tmp_path / "all", 'mode = "quant"\nbits = 4\ncuts = "all"\n')
        )
        assert s["state"] == "succeeded", s
        all_out = Path(s["output_dir"])
        assert s["compression_note"] is None
        plan = json.loads((all_out / "plan.json").read_text())
        assert [(c["codec"], c["bits"]) for c in plan["cuts"]] == [("quant", 4)] * len(plan["cuts"]), plan["cuts"]
        assert len(plan["cuts"]) >= 2
        summary = json.loads((all_out / "summary.json").read_text())
        assert summary["compression_note"] is None
        assert summary["final_loss"] < summary["first_loss"], summary
        dense, quantized = bytes_per_link(slow_out), bytes_per_link(all_out)
        assert dense.keys() == quantized.keys() and dense
        for link, size in quantized.items():
            # 4-bit codes with a float32 scale per 128 entries: 4.25 of 32 bits, plus headers
            # and the scalars that travel dense; loopback links carry the same tensors as before.
            assert size < dense[link] / 3, (link, size, dense[link])
    finally:
        client.close()
