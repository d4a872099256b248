"""The machine's cost of computing and transferring after a pause (testbeds.bench.machine_probe):
the curves, the timing loop, and what the replay makes of them (the probe itself runs in
tests/integration/test_pause_cost_probe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fusion.errors import ConfigError
from testbeds.bench.machine_probe import time_after_pauses
from testbeds.sim.machine import PauseCost, TransferPathCost, pause_cost_beside, transfer_path_beside
from testbeds.sim.replay import replay_step
from tests.unit.test_opfence import chain_workload, make_topology

CURVE = PauseCost((0.001, 0.01, 0.1), (0.0002, 0.001, 0.002), (0.0001, 0.0005, 0.001))


def test_the_curve_is_zero_without_a_pause_and_flat_beyond_the_longest() -> None:
    assert CURVE(0.0, False) == 0.0 and CURVE(-1.0, True) == 0.0
    assert CURVE(0.0005, False) == pytest.approx(0.0001)  # linear up to the shortest pause
    assert CURVE(0.01, False) == pytest.approx(0.001) and CURVE(0.01, True) == pytest.approx(0.0005)
    assert CURVE(np.sqrt(0.01 * 0.1), False) == pytest.approx(0.0015)  # halfway in log(pause)
    assert CURVE(10.0, False) == pytest.approx(0.002)


@pytest.mark.parametrize(
    "args",
    [
        ((), (), ()),
        ((0.01, 0.001), (0.0, 0.0), (0.0, 0.0)),
        ((0.0, 0.01), (0.0, 0.0), (0.0, 0.0)),
        ((0.01,), (2.0,), (0.0,)),
        ((0.01,), (0.0,), ()),
    ],
)
def test_a_malformed_curve_is_refused(args: tuple) -> None:
    with pytest.raises(ConfigError):
        PauseCost(*args)


def test_documents_round_trip_and_a_wrong_one_is_named(tmp_path: Path) -> None:
    assert PauseCost.from_dict(json.loads(json.dumps(CURVE.to_dict()))) == CURVE
    with pytest.raises(ConfigError, match="pauses_s"):
        PauseCost.from_dict({"pauses": [0.01]})
    assert pause_cost_beside(tmp_path) is None
    (tmp_path / "pause-cost.json").write_text(json.dumps({**CURVE.to_dict(), "trials": 5}))
    assert pause_cost_beside(tmp_path) == CURVE


PATH = TransferPathCost((1000, 2000), (0.0, 0.01, 0.1), ((0.001, 0.002), (0.003, 0.004), (0.005, 0.006)))


def test_the_transfer_path_by_size_and_quiet() -> None:
    assert PATH(1000, 0.0) == pytest.approx(0.001) and PATH(1500, 0.0) == pytest.approx(0.0015)
    assert PATH(500, 0.0) == pytest.approx(0.001)  # below the smallest size: its time
    assert PATH(3000, 0.0) == pytest.approx(0.003)  # beyond the largest: the last step's rate per byte
    assert PATH(1000, 0.005) == pytest.approx(0.002)  # linearly up to the shortest pause
    assert PATH(1000, np.sqrt(0.01 * 0.1)) == pytest.approx(0.004)  # in log(pause) beyond
    assert PATH(2000, 5.0) == pytest.approx(0.006)


@pytest.mark.parametrize(
    "args",
    [
        ((1000,), (0.0, 0.01), ((0.001,), (0.002,))),  # one size
        ((2000, 1000), (0.0, 0.01), ((0.001, 0.002), (0.001, 0.002))),  # sizes not increasing
        ((1000, 2000), (0.01, 0.1), ((0.001, 0.002), (0.001, 0.002))),  # no back-to-back row
        ((1000, 2000), (0.0, 0.01), ((0.001, 0.002),)),  # a row missing
        ((1000, 2000), (0.0, 0.01), ((0.001, 0.002), (0.001, -1.0))),  # a negative time
    ],
)
def test_a_malformed_transfer_path_is_refused(args: tuple) -> None:
    with pytest.raises(ConfigError):
        TransferPathCost(*args)


def test_the_transfer_path_is_read_from_the_same_file(tmp_path: Path) -> None:
    assert transfer_path_beside(tmp_path) is None
    (tmp_path / "pause-cost.json").write_text(json.dumps(CURVE.to_dict()))
    assert transfer_path_beside(tmp_path) is None  # an older file without it
    (tmp_path / "pause-cost.json").write_text(json.dumps({**CURVE.to_dict(), "transfer_path": PATH.to_dict()}))
    assert transfer_path_beside(tmp_path) == PATH and pause_cost_beside(tmp_path) == CURVE
    with pytest.raises(ConfigError, match="sizes"):
        TransferPathCost.from_dict({"sizes": [1]})
    (tmp_path / "pause-cost.json").write_text('{"pauses_s": [0.01')
    with pytest.raises(ConfigError, match="not JSON"):
        pause_cost_beside(tmp_path)
    (tmp_path / "pause-cost.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        transfer_path_beside(tmp_path)


def test_timing_a_computation_after_pauses() -> None:
    """A computation that runs 2 ms longer after more than 10 ms of quiet (a stand-in whose
    cost is known) shows that much extra after the long pause and none after the short."""
    import time

    last = [time.perf_counter()]

    def run() -> None:
        if time.perf_counter() - last[0] > 0.01:
            time.sleep(0.002)
        last[0] = time.perf_counter()

    extra = time_after_pauses(run, (0.001, 0.03), trials=5)
    assert extra[0.001] < 0.001
    assert 0.0015 < extra[0.03] < 0.02


def test_a_waiting_stage_pays_the_pause_and_a_busy_one_does_not() -> None:
    """The two-stage timeline of test_replay (f0=10 b0=20, f1=30 b1=50 ms; 1F1B, two
    micro-batches), each computation after a pause costing 5 ms more.

    s0 F0 0-10, F1 10-20 (back to back), act0 arrives 30 (link free 50), act1 sent 50
    (arrives 70). s1 F0 waited since 0: 30-65; B0 65-115, F1 115-145, B1 145-195 back to
    back; grad0 sent 115 (arrives 155, free 165), grad1 sent 195 (arrives 235, free 245).
    s0 B0 waited since 20: 155-180; B1 waited since 180: 235-260.
    """
    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1_000_000], grad_bytes=[1_000_000])
    topology = make_topology(np.array([[np.inf, 1e8], [5e7, np.inf]]), latency_s=np.array([[0.0, 0.01], [0.02, 0.0]]))
    replay = replay_step(
        wl, [0, 1], [0, 1], topology, micro_batches=2, pause_cost=lambda pause, busy: 0.005 if pause > 0 else 0.0
    )
    assert replay.stages_done_s == pytest.approx((0.26, 0.245))
    assert replay.compute_s == pytest.approx((0.07, 0.165))  # two paused actions on stage 0, one on stage 1


def test_the_pause_cost_knows_whether_another_core_is_computing() -> None:
    """Two stages on one two-core machine, f0=40 b0=10, f1=10 b1=10 ms, links instant.

    s0 F0 0-40 (no pause, s1 idle), F1 40-80 (back to back); s1 F0 40-50 after 40 ms, while
    s0 computes; B0 50-60 back to back, s0 still computing; s0 B0 80-90 (s1 idle since 60);
    s1 F1 80-90 after 20 ms, while s0 computes; B1 90-100 (s0 done at 90); s0 B1 100-110
    after 10 ms, s1 done at 100.
    """
    import dataclasses

    wl = chain_workload([0.04, 0.01], bwd_s=[0.01, 0.01], edge_bytes=[1], grad_bytes=[1])
    base = make_topology(np.array([[np.inf, 1e15], [1e15, np.inf]]))
    topology = dataclasses.replace(base, workers=tuple(dataclasses.replace(w, machine="m") for w in base.workers))
    calls: list[tuple[float, bool]] = []

    def cost(pause: float, busy: bool) -> float:
        calls.append((round(float(pause), 6), busy))
        return 0.0

    replay_step(wl, [0, 1], [0, 1], topology, micro_batches=2, cores=2, pause_cost=cost)
    assert calls == [
        (0.0, False),
        (0.0, False),
        (0.04, True),
        (0.0, True),
        (0.0, False),
        (0.02, True),
        (0.0, False),
        (0.01, False),
    ]


def test_an_emulated_device_stretches_its_pause_cost_too() -> None:
    """One stage emulating a device twice as slow sleeps after each computation, so every
    computation after the first comes after a pause, and its cost is stretched as well."""
    import dataclasses

    wl = chain_workload([0.01], bwd_s=[0.02])
    base = make_topology(np.full((1, 1), np.inf))
    slow = dataclasses.replace(base, workers=(dataclasses.replace(base.workers[0], slowdown=2.0),))
    plain = replay_step(wl, [0], [0], slow, micro_batches=2)
    paying = replay_step(
        wl, [0], [0], slow, micro_batches=2, pause_cost=lambda pause, busy: 0.005 if pause > 0 else 0.0
    )
    assert paying.step_s - plain.step_s == pytest.approx(3 * 2 * 0.005)
    assert paying.compute_s[0] - plain.compute_s[0] == pytest.approx(3 * 2 * 0.005)
    fast = replay_step(wl, [0], [0], base, micro_batches=2, pause_cost=lambda pause, busy: 0.005 if pause > 0 else 0.0)
    assert fast.step_s == pytest.approx(
        replay_step(wl, [0], [0], base, micro_batches=2).step_s
    )  # back to back: no pause
