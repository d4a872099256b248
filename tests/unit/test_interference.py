"""Transfer interference (testbeds.sim.machine): its costs by size, the fit that measures
them, and the replay that charges them to the computations a transfer overlaps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from fusion.errors import ConfigError, FusionError
from testbeds.bench.machine_probe import cost_per_transfer
from testbeds.sim.machine import TransferInterference, interference_beside, overlap_share
from testbeds.sim.replay import replay_step
from tests.unit.test_opfence import chain_workload, make_topology

SIZES = (16 << 10, 256 << 10, 1 << 20)


def test_costs_by_size_interpolate_and_extend_at_the_last_rate() -> None:
    cost = TransferInterference(SIZES, (0.001, 0.002, 0.004), (0.003, 0.003, 0.005))
    assert cost.send(1) == pytest.approx(0.001)  # below the smallest: the smallest's
    assert cost.send(136 << 10) == pytest.approx(0.0015)
    assert cost.receive(256 << 10) == pytest.approx(0.003)
    assert cost.send(2 << 20) == pytest.approx(
        0.004 + 0.002 * (1 << 20) / (768 << 10)
    )  # one more MB at 2 ms per 768 KB
    assert cost.receive(2 << 20) == pytest.approx(0.005 + 0.002 * (1 << 20) / (768 << 10))


@pytest.mark.parametrize(
    "args",
    [
        ((16,), (0.001,), (0.001,)),  # one size
        ((256, 16), (0.001, 0.001), (0.001, 0.001)),  # decreasing
        ((16, 256), (0.001,), (0.001, 0.001)),  # a cost missing
        ((16, 256), (0.001, -0.001), (0.001, 0.001)),  # negative
        ((16, 256), (0.001, 0.001), (0.001, 2.0)),  # beyond a second
    ],
)
def test_a_malformed_cost_is_refused(args: tuple) -> None:
    with pytest.raises(ConfigError):
        TransferInterference(*args)


def test_it_is_read_from_the_pause_cost_file(tmp_path: Path) -> None:
    assert interference_beside(tmp_path) is None
    cost = TransferInterference(SIZES, (0.001, 0.002, 0.004), (0.003, 0.003, 0.005))
    (tmp_path / "pause-cost.json").write_text(json.dumps({"pauses_s": [0.001], "idle_s": [0.0], "loaded_s": [0.0]}))
    assert interference_beside(tmp_path) is None  # an older file without it
    (tmp_path / "pause-cost.json").write_text(json.dumps({"interference": cost.to_dict()}))
    assert interference_beside(tmp_path) == cost
    (tmp_path / "pause-cost.json").write_text(json.dumps({"interference": {"sizes_bytes": [1, 2]}}))
    with pytest.raises(ConfigError, match="send_s"):
        interference_beside(tmp_path)


def test_the_overlapped_share_of_a_span() -> None:
    assert overlap_share(0.0, 1.0, 0.5, 1.5) == pytest.approx(0.5)
    assert overlap_share(0.0, 1.0, 0.2, 0.4) == pytest.approx(1.0)
    assert overlap_share(0.0, 1.0, 1.0, 2.0) == 0.0  # touching is not overlapping
    assert overlap_share(0.0, 1.0, -1.0, 3.0) == pytest.approx(0.25)
    assert overlap_share(0.0, 1.0, 0.5, 0.5) == 1.0  # a span of no length strictly inside
    assert overlap_share(0.0, 1.0, 0.0, 0.0) == 0.0


def test_the_fit_recovers_a_known_cost_per_transfer() -> None:
    """Computations of 20 ms that take 3 ms longer per transfer inside them (by the share
    inside), transfers of 5 ms at random gaps: the fit gives 3 ms."""
    rnd = random.Random(0)
    transfers, t = [], 0.0
    while t < 3.0:
        t += rnd.uniform(0.005, 0.03)
        transfers.append((t, t + 0.005))
        t += 0.005
    computations, t = [], 0.0
    while t < 2.9:
        end = t + 0.02
        for _ in range(10):  # its extra time moves which transfers it overlaps: settle that
            end = t + 0.02 + 0.003 * sum(overlap_share(t, end, a, b) for a, b in transfers)
        computations.append((t, end))
        t = end
    assert cost_per_transfer(computations, transfers) == pytest.approx(0.003, rel=1e-3)
    faster = cost_per_transfer([(0.0, 0.019), (0.02, 0.04), (0.04, 0.06)], [(0.005, 0.01)])
    assert faster == 0.0  # faster with a transfer inside: no cost, never a negative one


def test_too_little_to_fit_is_named() -> None:
    with pytest.raises(FusionError, match="too little"):
        cost_per_transfer([(0.0, 0.02)], [(0.005, 0.01)])
    with pytest.raises(FusionError, match="nothing to fit"):
        cost_per_transfer([(0.0, 0.02), (0.1, 0.12), (0.2, 0.22)], [(0.5, 0.6)])


def test_the_replay_charges_each_computation_the_transfers_it_overlaps() -> None:
    """Two stages on separate machines, instant links, every transfer 4 ms of path (the
    sender's half, then the receiver's); f0=10 b0=20, f1=30 b1=50 ms, 1F1B, two
    micro-batches; a transfer inside a computation costs it 2 ms sent, 3 ms received.

    The placement it settles on: s0 F0 0-10, F1 10-22 (act0 leaves at 10, its send 10-12
    inside F1), act1 leaves 22 and arrives 26; s1 F0 14-47 (act1 received 24-26 inside),
    B0 47-97, grad0 leaves 97 (its send 97-99 inside F1 97-129), B1 129-179, grad1 leaves
    179, arrives 183; s0 B0 101-121 and B1 183-203 (each gradient arrives as it starts).
    """
    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1_000_000], grad_bytes=[1_000_000])
    topology = make_topology(np.array([[np.inf, 1e15], [1e15, np.inf]]))
    cost = TransferInterference((1, 2_000_000), (0.002, 0.002), (0.003, 0.003))
    plain = replay_step(wl, [0, 1], [0, 1], topology, micro_batches=2, transfer_cost=lambda size, pause: 0.004)
    paying = replay_step(
        wl, [0, 1], [0, 1], topology, micro_batches=2, transfer_cost=lambda size, pause: 0.004, interference=cost
    )
    assert plain.compute_s == pytest.approx((0.06, 0.16))
    assert paying.compute_s == pytest.approx((0.062, 0.165))
    assert paying.stages_done_s == pytest.approx((0.203, 0.183), abs=1e-6)
    assert paying.step_s == pytest.approx(plain.step_s + 0.005, abs=1e-6)


def test_an_emulated_device_pays_its_interference_stretched() -> None:
    """The same two stages with stage 1 emulating a device twice as slow: the transfers
    that overlap its time on the core cost it twice (it sleeps the other half)."""
    import dataclasses

    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1_000_000], grad_bytes=[1_000_000])
    base = make_topology(np.array([[np.inf, 1e15], [1e15, np.inf]]))
    slow = dataclasses.replace(base, workers=(base.workers[0], dataclasses.replace(base.workers[1], slowdown=2.0)))
    cost = TransferInterference((1, 2_000_000), (0.0, 0.0), (0.003, 0.003))  # received transfers only
    plain = replay_step(wl, [0, 1], [0, 1], slow, micro_batches=2, transfer_cost=lambda size, pause: 0.004)
    paying = replay_step(
        wl, [0, 1], [0, 1], slow, micro_batches=2, transfer_cost=lambda size, pause: 0.004, interference=cost
    )
    # s1 F0 starts at 14 and is on the core for its first 30 ms: act1, received 20-24 (s0's F1 ends at 20), lies inside.
    assert paying.compute_s[1] - plain.compute_s[1] == pytest.approx(2 * 0.003)
    assert paying.compute_s[0] == pytest.approx(plain.compute_s[0])
