"""Time dilation (:mod:`testbeds.dilation`): compute factors, link rates and latencies scaled
by ``D``, reported times divided by it, and the labels that say so."""

from __future__ import annotations

import math
import time

import pytest

from fusion.errors import ConfigError
from fusion.profiling import DeviceProfile
from scheduler.topology import Topology
from testbeds.bench.dilation_check import fast_topology, job_toml
from testbeds.dilation import (
    check_dilation,
    dilate_topology,
    dilated_slowdowns,
    dilated_timeout_s,
    dilation_label,
    undilate_row,
    undilate_s,
)
from testbeds.emulation import Slowdown
from testbeds.net.launch import summary_lines, worker_command
from testbeds.worker import emulated_profile

TOPOLOGY = """
[[hosts]]
name = "a"
cluster = "s1"
[[hosts]]
name = "b"
cluster = "s2"
slowdown = 3
[[links]]
from = "s1"
to = "s2"
bandwidth_mbps = 100
latency_ms = 20
"""


@pytest.mark.parametrize("bad", [0.5, 0, -2, math.inf, math.nan, True, "4"])
def test_a_dilation_below_one_or_not_a_number_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="dilation must be a finite number >= 1"):
        check_dilation(bad)  # type: ignore[arg-type]


def test_links_carry_d_times_less_with_d_times_the_latency() -> None:
    topo = Topology.from_toml(TOPOLOGY)
    dilated = dilate_topology(topo, 4)
    assert dilated.bandwidth_bytes_per_s[0][1] == pytest.approx(topo.bandwidth_bytes_per_s[0][1] / 4)
    assert dilated.latency_s[1][0] == pytest.approx(topo.latency_s[1][0] * 4)
    assert dilated.bandwidth_bytes_per_s[0][0] == math.inf and dilated.latency_s[0][0] == 0.0
    assert dilated.workers == topo.workers  # compute is dilated by the workers, not here
    assert dilate_topology(topo, 1) is topo


def test_every_host_computes_d_times_slower_on_top_of_its_own_slowdown() -> None:
    assert dilated_slowdowns({"b": 3.0}, ["a", "b"], 4) == {"a": 4.0, "b": 12.0}
    assert dilated_slowdowns({"b": 3.0}, ["a", "b"], 1) == {"b": 3.0}
    assert dilated_timeout_s(10.0, 6) == 60.0


def test_a_dilated_computation_ends_d_times_its_cpu_time_after_it_began() -> None:
    slow = Slowdown(3.0, dilation=4.0)
    # 0.1 s of CPU that took 0.5 s of wall (it waited for a core): device time 4 * 3 * 0.1.
    assert slow.extra_s(0.5, cpu_s=0.1) == pytest.approx(1.2 - 0.5)
    # A wait longer than the dilated time cannot be taken back: no sleep.
    assert slow.extra_s(2.0, cpu_s=0.1) == 0.0
    # Without a CPU time the wall time stands in (the baselines' hooks).
    assert slow.extra_s(0.1) == pytest.approx(12 * 0.1 - 0.1)
    # No dilation: the old stretch, factor - 1 times the wall time.
    assert Slowdown(3.0).extra_s(0.1, cpu_s=0.01) == pytest.approx(0.2)
    assert Slowdown(1.0, dilation=2.0).active and not Slowdown(1.0).active


def test_profile_emulation_is_dilated_too() -> None:
    slow = Slowdown(3.0, emulation="profile", dilation=2.0)
    # D * (own + (factor - 1) * reference) - wall = 2 * (0.1 + 2 * 0.2) - 0.1
    assert slow.extra_s(0.1, reference_s=0.2, cpu_s=0.1) == pytest.approx(0.9)


def test_the_sleep_is_real() -> None:
    t0 = time.perf_counter()
    slept = Slowdown(1.0, dilation=3.0).stretch(0.02, cpu_s=0.02)
    assert slept == pytest.approx(0.04)
    assert time.perf_counter() - t0 >= 0.04


def test_a_dilated_worker_reports_a_speed_d_times_lower_and_says_so() -> None:
    profile = DeviceProfile(
        num_cores=2,
        memory_bytes=1 << 30,
        device="cpu",
        device_name="CPU",
        device_memory_bytes=1 << 30,
        matmul_flops=1e11,
    )
    seen = emulated_profile(profile, 2.0, 8e10, dilation=4.0)
    assert seen.matmul_flops == pytest.approx(8e10 / 8)
    assert seen.device_name == "CPU, 2x slower, dilated x4"
    assert emulated_profile(profile, 1.0, None, dilation=1.0).device_name == "CPU"


def test_reported_times_are_divided_by_d_and_rates_multiplied() -> None:
    row = {
        "step_s": 8.0,
        "predicted_step_s": 4.0,
        "time_to_target_s": 80.0,
        "step_s_rounds": [8.0, 16.0],
        "compute_s": {"a": 2.0},
        "samples_per_s": 10.0,
        "tokens_per_s": None,
        "final_loss": 1.5,
        "slowest_link_bytes": 1000,
    }
    out = undilate_row(row, 4)
    assert out["step_s"] == 2.0 and out["predicted_step_s"] == 1.0 and out["time_to_target_s"] == 20.0
    assert out["step_s_rounds"] == [2.0, 4.0] and out["compute_s"] == {"a": 0.5}
    assert out["samples_per_s"] == 40.0 and out["tokens_per_s"] is None
    assert out["final_loss"] == 1.5 and out["slowest_link_bytes"] == 1000
    assert undilate_row(row, 1) == row
    assert undilate_s(6.0, 3) == 2.0 and undilate_s(None, 3) is None


def test_labels_say_dilated() -> None:
    assert dilation_label(4) == "dilated x4" and dilation_label(2.5) == "dilated x2.5"
    assert dilation_label(1) == ""
    status = {"id": "j", "state": "succeeded", "step": 2, "steps": 2, "loss": 1.0, "samples_per_s": 10.0}
    assert "40.0 samples/s (dilated x4)" in summary_lines(status, 4.0)[1]
    assert "dilated" not in summary_lines(status)[1]


def test_the_launcher_passes_the_dilation_to_every_worker() -> None:
    common = dict(coordinator="c:1", token_file="t", name="w", listen="l:2", torch_threads=1, machine_flops=1e9)
    argv = worker_command(**common, dilation=6.0)  # type: ignore[arg-type]
    assert argv[argv.index("--dilate") + 1] == "6.0"
    assert "--dilate" not in worker_command(**common)  # type: ignore[arg-type]


def test_the_check_splits_its_model_evenly_over_fast_links() -> None:
    topo = fast_topology(4)
    assert len(topo) == 4 and topo.bandwidth_bytes_per_s[0][3] == pytest.approx(10_000e6 / 8)
    assert len(fast_topology(1)) == 1
    text = job_toml(num_stages=4, micro_batches=16, micro_batch_size=8, steps=3, out_dir="/tmp/x")  # type: ignore[arg-type]
    assert 'strategy = "uniform"' in text and "min_workers = 4" in text and "batch_size = 128" in text
