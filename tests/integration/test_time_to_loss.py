"""AdaTopK's choice for time to loss, end to end: ``fusion plan`` prints each cut's codec per
direction, its convergence cost and its predicted time to loss against dense (calibrated on
the job's own tiny GPT-2), and a job on a real coordinator and three real workers records,
per link and step, the codec, its ratio and bits, the bytes before and after, and the
relative error of what was sent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion.coordinator.client import CoordinatorClient
from fusion.launch import Fleet, child_env
from tests.integration.test_compression_cuts import TINY_MODEL, job_file, run_job

TOKEN = "time-to-loss-token-0123456789"

pytestmark = pytest.mark.timeout(600)

GPT2_JOB = """
name = "ttl"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 8
seq_len = 16
[train]
steps = 4
micro_batches = 4
[plan]
strategy = "uniform"  # a stage on each host, so one cut crosses the slow link
[compression]
mode = "adatopk"
"""

#: Two sites over a slow link: the cut between them is slow, the one inside a site is not.
TOPOLOGY = """
[[hosts]]
name = "a-1"
cluster = "a"
flops = 1.0e13
[[hosts]]
name = "a-2"
cluster = "a"
flops = 1.0e13
[[hosts]]
name = "b-1"
cluster = "b"
flops = 1.0e13
[[links]]
from = "a"
to = "a"
bandwidth_mbps = 10000
latency_ms = 0.1
[[links]]
from = "a"
to = "b"
bandwidth_mbps = 8
latency_ms = 40
"""


def fusion_plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.toml").write_text(textwrap.dedent(GPT2_JOB))
    (tmp_path / "topo.toml").write_text(textwrap.dedent(TOPOLOGY))
    cmd = [sys.executable, "-m", "fusion.cli.main", "plan", str(tmp_path / "job.toml")]
    cmd += ["--topology", str(tmp_path / "topo.toml"), *args]
    return subprocess.run(cmd, env=child_env([]), capture_output=True, text=True, timeout=400)


def test_fusion_plan_prints_codecs_per_direction_and_convergence_cost(tmp_path: Path) -> None:
    done = fusion_plan(tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    summary = plan["extra"]["compression"]
    assert summary["calibrated"] is True
    assert summary["convergence_cost"] >= 1.0 and summary["time_to_loss_vs_dense"] <= 1.0
    compressed = [c for c in plan["cuts"] if c["codec"] != "none" or c["gradient_codec"] not in (None, "none")]
    # The 8 Mbps cut carries a 16 KiB activation per micro-batch: compressing pays.
    assert compressed, plan["cuts"]
    for c in plan["cuts"]:
        assert {"gradient_codec", "gradient_keep_ratio", "gradient_bits"} <= c.keys()
        assert c["convergence_cost"] >= 1.0 and 0.0 < c["time_to_loss_vs_dense"] <= 1.0, c
    text = fusion_plan(tmp_path)
    assert text.returncode == 0, text.stderr
    header = next(line for line in text.stdout.splitlines() if line.strip().startswith("cut"))
    assert header.split() == ["cut", "MB/mb", "codec", "keep", "bits", "grad", "codec", "keep", "bits", "m", "T/dense"]
    assert "errors calibrated on the job" in text.stdout and "convergence cost m = " in text.stdout
    prior = fusion_plan(tmp_path, "--no-calibrate")
    assert prior.returncode == 0 and "prior errors, not calibrated" in prior.stdout, prior.stdout


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp_path = tmp_path_factory.mktemp("ttl")
    code = tmp_path / "code"
    code.mkdir()
    (code / "tiny_models.py").write_text(TINY_MODEL)
    with Fleet(tmp_path / "logs", extra_pythonpath=[str(code)]) as f:
        f.start_coordinator(token=TOKEN, state_dir=tmp_path / "state")
        for name in ("w0", "w1", "w2"):
            f.start_worker(name, token=TOKEN, allow_code=True)
        yield f


def test_a_job_records_codec_bytes_and_error_per_link(fleet: Fleet, tmp_path: Path) -> None:
    client = CoordinatorClient(fleet.coordinator_address, TOKEN)
    try:
        _, s = run_job(
            client, job_file(tmp_path / "q.toml", tmp_path / "q", 'mode = "quant"\nbits = 8\ncuts = "all"\n')
        )
        assert s["state"] == "succeeded", s
        out = Path(s["output_dir"])
        plan = json.loads((out / "plan.json").read_text())
        assert plan["extra"]["compression"]["calibrated"] is True
        assert all(c["codec"] == "quant" and c["convergence_cost"] > 1.0 for c in plan["cuts"]), plan["cuts"]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [r for r in records if "bytes_per_link" in r]
        assert steps
        for r in steps:
            links = r["compression"]
            assert set(links) == set(r["bytes_per_link"]), (links, r["bytes_per_link"])  # both directions
            for link, c in links.items():
                assert (c["codec"], c["keep_ratio"], c["bits"]) == ("quant", 1.0, 8), (link, c)
                assert c["sent_bytes"] < c["dense_bytes"] / 3, (link, c)
                assert 0.0 < c["rel_error"] < 0.05, (link, c)  # 8-bit block quantization
            assert 1.0 < r["convergence_cost"] < 1.05

        _, s = run_job(client, job_file(tmp_path / "a.toml", tmp_path / "a", 'mode = "adatopk"\ncuts = "all"\n'))
        assert s["state"] == "succeeded", s
        plan = json.loads((Path(s["output_dir"]) / "plan.json").read_text())
        summary = plan["extra"]["compression"]
        assert summary["calibrated"] is True and summary["time_to_loss_vs_dense"] <= 1.0, summary
        assert all(c["time_to_loss_vs_dense"] <= 1.0 for c in plan["cuts"]), plan["cuts"]
    finally:
        client.close()
