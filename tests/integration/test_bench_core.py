"""``python -m testbeds.bench_core``'s transport part keeps its JSON contract and measures
every path for real: one executor process, its data plane, gRPC and a raw socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_transport_part_reports_rates_round_trip_and_cpu_per_transfer() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbeds.bench_core",
            "--skip-steps",
            "--sizes-mib",
            "1",
            "--repeats",
            "1",
            "--cpu-sizes-kib",
            "64",
            "--cpu-seconds",
            "0.5",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)

    (row,) = out["transport"]
    assert row["size_mib"] == 1
    for key in ("grpc_mb_per_s", "data_plane_mb_per_s", "unix_mb_per_s", "socket_mb_per_s"):
        assert row[key] > 0, key
    assert row["ratio"] == pytest.approx(row["data_plane_mb_per_s"] / row["socket_mb_per_s"], rel=0.01)
    assert {"grpc_ms", "data_plane_ms", "unix_ms", "socket_ms"} <= set(out["round_trip"])

    cpu = {r["path"]: r for r in out["cpu_per_transfer"]}
    assert set(cpu) == {"data", "socket"}
    for path, r in cpu.items():
        assert r["size_kib"] == 64 and r["transfers"] > 0
        # Every transfer is sent by this process and received by another: both spend CPU.
        assert r["wall_us"] > 0 and r["sender_cpu_us"] > 0 and r["receiver_cpu_us"] > 0, (path, r)


def test_step_part_interleaves_rounds_of_every_system() -> None:
    """Two rounds of a tiny GPT-2, each running the single process and both splits over two
    workers once: every system has a step per round and its ratio is read within rounds."""
    from testbeds.bench.core import bench_steps

    rows = bench_steps("tiny", [2], steps=2, batch_size=2, seq_len=8, micro_batches=2, device="cpu", rounds=2)

    assert [r["system"] for r in rows] == ["single-process", "fusion-uniform-2", "fusion-compute-2"]
    single, *splits = rows
    assert single["ratio"] == 1.0 and single["workers"] == 1
    for r in rows:
        assert len(r["rounds_step_s"]) == 2 and all(s > 0 for s in r["rounds_step_s"]), r
    assert single["rounds_ratio"] == [1.0, 1.0]
    for r in splits:
        assert r["workers"] == 2
        # The split sends activations and gradients between its two stages every step.
        assert r["max_link_bytes_per_step"] > 0, r
        assert len(r["rounds_ratio"]) == 2 and min(r["rounds_ratio"]) <= r["ratio"] <= max(r["rounds_ratio"]), r


def test_each_compared_path_is_timed_first_after_the_settle_pause_equally_often() -> None:
    """The transfer right after gRPC's settle pause runs cold and slow; no path may get that
    slot more often than another (a rotation of one cyclic order gave it to the data plane
    in three repeats of four)."""
    from testbeds.bench.transport import COMPARED, interleaved_orders

    for repeats in (1, 3, 7, 9):
        orders = interleaved_orders(repeats)
        assert len(orders) >= repeats and len(orders) % len(COMPARED) == 0
        assert all(sorted(o) == sorted([*COMPARED, "grpc"]) and o[-1] == "grpc" for o in orders)
        # The first path of each repeat follows the previous repeat's pause (or the warm-up).
        firsts = [o[0] for o in orders]
        assert {p: firsts.count(p) for p in COMPARED} == {p: len(orders) // len(COMPARED) for p in COMPARED}
