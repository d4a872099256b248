"""The side-by-side benchmark on a real netns testbed: a very short run, JSON contract and losses.

Needs root (network namespaces, ``tc``); skipped otherwise. Two hosts, two steps of GPT-2
tiny, all four systems: about a minute on 2 cores. The far host is declared
half as fast and the run emulates it (``--emulate-speeds``), so the emulation's path through
fusion's workers, their reports to the planner and the DDP ranks is covered too.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the netns testbed needs root"),
    pytest.mark.timeout(420),
]

TOPOLOGY = """
[[hosts]]
name = "near"
flops = 2.0e12
[[hosts]]
name = "far"
flops = 1.0e12
[[links]]
from = "near"
to = "far"
bandwidth_mbps = 50
latency_ms = 5
"""

JOB = """
name = "bench-test"
[model]
name = "gpt2"
preset = "tiny"
[data]
batch_size = 8
seq_len = 32
[train]
steps = 2
micro_batches = 2
"""


def _testbed_files(tmp_path: Path) -> Path:
    """Write the pair topology and the job into ``tmp_path`` (skip where netns is missing);
    the results' path prefix."""
    from testbeds.net.testbed import netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    (tmp_path / "pair.toml").write_text(TOPOLOGY)
    (tmp_path / "job.toml").write_text(JOB)
    return tmp_path / "result"


def test_short_bench_run_keeps_the_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from testbeds.bench.harness import main

    out = _testbed_files(tmp_path)
    rc = main(
        [
            "--topology",
            str(tmp_path / "pair.toml"),
            "--job",
            str(tmp_path / "job.toml"),
            "--systems",
            "fusion,uniform,ddp,pipelining",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            "--out",
            str(out),
            "--timeout",
            "240",
            "--emulate-speeds",
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["systems"]) == {"fusion", "uniform", "ddp", "pipelining"}
    for name, row in doc["systems"].items():
        assert {"samples_per_s", "step_s", "slowest_link_bytes", "final_loss"} <= set(row), name
        assert row["step_s"] is not None and row["step_s"] > 0, (name, row.get("note"))
        assert math.isfinite(row["final_loss"]), name
        assert row["samples_per_s"] == pytest.approx(8 / row["step_s"], rel=1e-3)
    # Same model, same data, two steps: every system's loss is the mean loss of one batch.
    losses = [row["final_loss"] for row in doc["systems"].values()]
    assert max(losses) - min(losses) < 0.05 * abs(losses[0])
    assert set(doc["speedup"]) == {"uniform", "ddp", "pipelining"}
    assert doc["speedup"]["ddp"] == pytest.approx(doc["systems"]["ddp"]["step_s"] / doc["systems"]["fusion"]["step_s"])
    assert doc["efficiency"] is None or doc["efficiency"] > 0
    # uniform splits the model over both hosts: its bytes cross the 50 Mbps link.
    assert doc["systems"]["uniform"]["slowest_link_bytes"] > 0
    # DDP's ring all-reduce over two ranks: each sends the whole gradient once per step, so
    # the link carries 2x its bytes (plus TCP/IP headers and acks), counted once each even
    # where the 5 ms latency routes them through the delay line's TUN device first (twice
    # would be over 4x). What is still in the delay line when a step ends reaches eth0, and
    # its count, in the next one: one timed step can come out up to a segment short per rank.
    from fusion.models import build_model

    grad_bytes = sum(p.numel() * p.element_size() for p in build_model("gpt2", "tiny").parameters())
    assert 1.5 * grad_bytes < doc["systems"]["ddp"]["slowest_link_bytes"] < 2.6 * grad_bytes
    # The coordinator's profile travels with the result, so the simulator replays its costs.
    assert doc["profile"]["nodes"] and doc["profile"]["matmul_flops"] > 0
    assert {"control_s", "micro_batch_s", "optimizer_s_per_byte"} <= set(doc["step_costs"])
    assert doc["profile"]["compute_factor"] > 0  # the calibration's level for the node costs
    # ... and so does what fusion's coordinator measured: both hosts run on this machine's CPU.
    measured = doc["measured"]["topology"]
    assert {w["name"] for w in measured["workers"]} == {"near", "far"} and len(
        {w["machine"] for w in measured["workers"]}
    ) == 1
    # far emulated a device half as fast; the planner saw exactly that ratio, and the table says so.
    assert doc["emulated_slowdown"] == {"far": 2.0}
    speed = {w["name"]: w["flops"] for w in measured["workers"]}
    assert speed["far"] == pytest.approx(speed["near"] / 2)
    assert "Emulated slower devices" in Path(f"{out}.md").read_text()
    for suffix in (".md", ".json", ".png"):
        assert Path(f"{out}{suffix}").stat().st_size > 0


def test_profile_emulation_reaches_every_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--emulation profile``: fusion's workers and the baselines' ranks on the emulated host
    stretch by the coordinator's profile, and the result says so."""
    from testbeds.bench.harness import main

    out = _testbed_files(tmp_path)
    args = [
        "--topology",
        str(tmp_path / "pair.toml"),
        "--job",
        str(tmp_path / "job.toml"),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        "--timeout",
        "240",
        "--emulate-speeds",
        "--emulation",
        "profile",
    ]
    assert main([*args, "--systems", "ddp,fusion"]) == 2  # the baselines need fusion's profile first
    assert "list fusion or uniform before ddp" in capsys.readouterr().err
    assert main([*args, "--systems", "fusion,uniform,ddp,pipelining", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["emulation"] == "profile" and doc["emulated_slowdown"] == {"far": 2.0}
    for name, row in doc["systems"].items():
        assert row["step_s"] is not None and row["step_s"] > 0 and math.isfinite(row["final_loss"]), (
            name,
            row.get("note"),
        )
    losses = [row["final_loss"] for row in doc["systems"].values()]
    assert max(losses) - min(losses) < 0.05 * abs(losses[0])
    assert "times their seconds in fusion's coordinator profile" in Path(f"{out}.md").read_text()
