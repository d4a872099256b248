"""The event replay of the executor's step (testbeds.sim.replay), against hand-computed timelines."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scheduler.estimator import StepCosts, estimate
from testbeds.sim.replay import _SendQueue, replay_step
from tests.unit.test_opfence import MB, chain_workload, make_topology


def test_one_stage_without_a_driver_equals_the_closed_form() -> None:
    step = StepCosts(control_s=0.05, micro_batch_s=0.001, optimizer_s_per_byte=1e-9)
    wl = chain_workload([0.001, 0.002], bwd_s=[0.002, 0.004], param_bytes=[MB, 2 * MB], step=step)
    topology = make_topology(np.full((1, 1), np.inf))
    est = estimate(wl, [0, 0], [0], topology, micro_batches=4)
    replay = replay_step(wl, [0, 0], [0], topology, micro_batches=4)
    assert replay.step_s == pytest.approx(est.step_s)


def test_two_stages_over_a_latency_link_by_hand() -> None:
    """f0=10 b0=20, f1=30 b1=50 ms; 0->1 10 ms + 1 MB at 100 MB/s, 1->0 20 ms + 1 MB at 50 MB/s.

    Stage 0 (depth 1) runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1. Sends are paced at the
    link's bandwidth: activations arrive 20 ms after they leave and keep the link 10 ms (their
    bytes), answered 20 ms after arriving; gradients arrive after 40 ms and keep it 20 ms.

    s0 F0 0-10, act0 sent 10 (arrives 30, answered 50); s0 F1 10-20, act1 sent 20 (arr 40,
    answered 60); s1 F0 30-60, B0 60-110, grad0 sent 110 (arr 150, answered 160); s1 F1
    110-140, B1 140-190, grad1 sent 190 (arr 230, answered 240); s0 B0 150-170, B1 230-250.
    Stage 1 is done when its last send is answered (240), stage 0 at 250. (Waiting for each
    answer would have sent act1 at 50 instead: stage 1 was busy until 110 anyway.)
    """
    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1_000_000], grad_bytes=[1_000_000])
    bw = np.array([[np.inf, 1e8], [5e7, np.inf]])
    lat = np.array([[0.0, 0.01], [0.02, 0.0]])
    replay = replay_step(wl, [0, 1], [0, 1], make_topology(bw, latency_s=lat), micro_batches=2)
    assert replay.stages_done_s == pytest.approx((0.25, 0.24))
    assert replay.step_s == pytest.approx(0.25)
    # A two-stage chain reaches its bottleneck at once: the closed form agrees here.
    assert estimate(wl, [0, 1], [0, 1], make_topology(bw, latency_s=lat), micro_batches=2).step_s == pytest.approx(0.25)


def test_gpipe_runs_every_forward_first() -> None:
    """Same stages, GPipe: stage 1 runs F0 F1 B0 B1, so B0 waits for F1 (input at 40 ms).

    s1 F0 30-60, F1 60-90, B0 90-140, grad0 sent 140 (arr 180, link free 160), B1 140-190,
    grad1 sent 190 (arr 230, answered 240); s0 B0 180-200, B1 230-250. Waiting for each
    answer, act1 would have left at 50 (arriving at 70) and everything ended 10 ms later.
    """
    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1_000_000], grad_bytes=[1_000_000])
    bw = np.array([[np.inf, 1e8], [5e7, np.inf]])
    lat = np.array([[0.0, 0.01], [0.02, 0.0]])
    replay = replay_step(wl, [0, 1], [0, 1], make_topology(bw, latency_s=lat), micro_batches=2, schedule="gpipe")
    assert replay.stages_done_s == pytest.approx((0.25, 0.24))
    # One at a time (paced_sends false): act1 left at 50, once act0's answer was back; s1 F1
    # 70-100, B0 100-150, grad0 sent 150 (arr 190, free 200), B1 150-200, grad1 sent 200 (arr
    # 240, answered 250); s0 B0 190-210, B1 240-260.
    unpaced = dataclasses.replace(make_topology(bw, latency_s=lat), paced_sends=False)
    replay = replay_step(wl, [0, 1], [0, 1], unpaced, micro_batches=2, schedule="gpipe")
    assert replay.stages_done_s == pytest.approx((0.26, 0.25))


def test_the_driver_feeds_one_send_after_another() -> None:
    """One stage on a worker 100 ms (round trip) from the driver, 1 MB/s; inputs and targets
    of 1 kB each per micro-batch, compute 1 + 2 ms.

    The sends leave with RunStep (which returns after 100 ms); each micro-batch's two take
    2 x 101 ms, its targets arriving 50 + 1 ms after the second starts: at 152, 354 and
    556 ms. The last backward ends at 559; the stage runs its (free) optimizer step and the
    driver hears it 50 ms later: 609.
    """
    step = StepCosts(target_bytes=1000)
    wl = chain_workload([0.001], bwd_s=[0.002], input_bytes=[1000], step=step)
    topology = make_topology(np.array([[np.inf, 1e6], [1e6, np.inf]]), latency_s=0.05).with_driver_at(0)
    unpaced = dataclasses.replace(topology, paced_sends=False)
    replay = replay_step(wl, [0], [1], unpaced, micro_batches=3)
    assert replay.stages_done_s == pytest.approx((0.609,))
    assert replay.apply_s == pytest.approx(0.0)
    assert replay.step_s == pytest.approx(0.609)
    # What testbeds.bench.timeline sets beside a trace: RunStep, the last target, the stage's own end.
    assert replay.run_step_s == pytest.approx(0.1)
    assert replay.fed_s == pytest.approx({0: 0.556})
    assert replay.finished_s == pytest.approx((0.559,))


def test_a_paced_feed_holds_the_link_for_its_bytes() -> None:
    """The same stage and feed, paced as the coordinator's driver sends it: each send starts
    as the bytes of the one before have left (1 ms each), and arrives 50 + 1 ms after it
    starts, RunStep beside them (it reaches the stage at 50 ms); the targets arrive at 52, 54
    and 56 ms; each micro-batch computes 3 ms once its targets are in: done at 55, 58,
    61 ms; the stage applies (free here) and the driver hears it 50 ms later: 111 ms."""
    step = StepCosts(target_bytes=1000)
    wl = chain_workload([0.001], bwd_s=[0.002], input_bytes=[1000], step=step)
    topology = make_topology(np.array([[np.inf, 1e6], [1e6, np.inf]]), latency_s=0.05).with_driver_at(0)
    replay = replay_step(wl, [0], [1], topology, micro_batches=3)
    assert replay.stages_done_s == pytest.approx((0.111,))
    assert replay.step_s == pytest.approx(0.111)
    assert replay.fed_s == pytest.approx({0: 0.056})
    assert replay.finished_s == pytest.approx((0.061,))


def test_stages_on_one_machine_take_turns_beyond_its_cores() -> None:
    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1000], grad_bytes=[1000])
    apart = replay_step(wl, [0, 1], [0, 1], make_topology(np.array([[np.inf, 1e15], [1e15, np.inf]])), micro_batches=4)
    one_core = replay_step(wl, [0, 1], [0, 0], make_topology(np.full((1, 1), np.inf)), micro_batches=4, cores=1)
    two_cores = replay_step(wl, [0, 1], [0, 0], make_topology(np.full((1, 1), np.inf)), micro_batches=4, cores=2)
    # One core does all 4 x 110 ms of compute one after another; two run the stages as two
    # free machines would.
    assert one_core.step_s == pytest.approx(4 * 0.11)
    assert two_cores.step_s == pytest.approx(apart.step_s)
    assert two_cores.step_s < one_core.step_s


def test_an_emulated_slow_device_leaves_its_core_to_the_others() -> None:
    """Two stages on one single-core machine, stage 1's worker half as fast (130 ms of
    compute per micro-batch for stage 0's 30). A real slower device on that machine holds the
    core all along: 4 x 190 ms one at a time. An emulated one (``slowdown`` 2: it sleeps half
    its compute) holds it for 65 ms of each 130, so stage 0 computes in the gaps."""
    import dataclasses

    wl = chain_workload([0.01, 0.03], bwd_s=[0.02, 0.05], edge_bytes=[1000], grad_bytes=[1000])
    base = make_topology(np.array([[np.inf, 1e15], [1e15, np.inf]]))

    def on_one_machine(w1: dict[str, float]) -> object:
        workers = (
            dataclasses.replace(base.workers[0], machine="m"),
            dataclasses.replace(base.workers[1], machine="m", **w1),
        )
        return dataclasses.replace(base, workers=workers)

    real = replay_step(wl, [0, 1], [0, 1], on_one_machine({"flops": 0.5e12}), micro_batches=4, cores=1)
    emulated = replay_step(wl, [0, 1], [0, 1], on_one_machine({"slowdown": 2.0}), micro_batches=4, cores=1)
    assert real.step_s == pytest.approx(4 * (0.03 + 2 * 0.08))
    assert 4 * 2 * 0.08 <= emulated.step_s < real.step_s


def test_an_emulated_device_runs_its_optimizer_at_the_machines_speed() -> None:
    """testbeds.emulation stretches forward and backward only: the optimizer update of an
    emulated slow device costs what it costs on the machine, a real slow device's more."""
    import dataclasses

    step = StepCosts(optimizer_s_per_byte=1e-8)
    wl = chain_workload([0.01], bwd_s=[0.02], param_bytes=[MB], step=step)
    base = make_topology(np.full((1, 1), np.inf))

    def with_worker(**kw: float) -> object:
        return dataclasses.replace(base, workers=(dataclasses.replace(base.workers[0], **kw),))

    plain = replay_step(wl, [0], [0], base, micro_batches=2)
    emulated = replay_step(wl, [0], [0], with_worker(slowdown=2.0), micro_batches=2)
    real = replay_step(wl, [0], [0], with_worker(flops=0.5e12), micro_batches=2)
    assert emulated.apply_s == pytest.approx(plain.apply_s) and real.apply_s == pytest.approx(2 * plain.apply_s)
    assert emulated.step_s == pytest.approx(real.step_s - plain.apply_s)  # compute stretched alike


def test_a_send_starts_at_the_answer_to_the_one_before_if_that_is_sooner_than_its_bytes() -> None:
    """As ``executor.sender.PeerSender``: a link held longer than the answer takes (a
    bandwidth below the real one) is never slower than one transfer at a time."""
    q = _SendQueue()
    assert q.send(0.0, one_way_s=1.0, busy_s=0.5, back_s=0.5) == 1.0  # paced: the next may start at 0.5
    assert q.send(0.0, one_way_s=1.0, busy_s=0.5, back_s=0.5) == 1.5  # started at 0.5, its bytes gone at 1.0
    slow = _SendQueue()
    slow.send(0.0, one_way_s=1.0, busy_s=10.0, back_s=0.5)  # bytes "gone" at 10 s, answered at 1.5 s
    assert slow.send(0.0, one_way_s=1.0, busy_s=10.0, back_s=0.5) == 2.5  # started at the answer
    assert slow.answered_at == 3.0


def test_profile_emulation_pays_the_machines_extra_once_and_sleeps_the_profile() -> None:
    """One stage, 10 / 20 ms profiled, on a worker emulating a device 3x slower, and a
    constant 4 ms cost of computing after a pause. ``wall`` emulation stretches all of it:
    3 x (10 + 4) and 3 x (20 + 4) ms per micro-batch. ``profile``: 10 + 4 ms on the core, then
    2 x 10 ms asleep (and 20 + 4, then 2 x 20 for the backward)."""
    wl = chain_workload([0.01], bwd_s=[0.02], step=StepCosts())
    base = make_topology(np.full((1, 1), np.inf))
    slow = dataclasses.replace(base, workers=(dataclasses.replace(base.workers[0], slowdown=3.0),))

    def pause(_s: float, _busy: bool) -> float:
        return 0.004

    wall = replay_step(wl, [0], [0], slow, micro_batches=2, pause_cost=pause)
    profile = replay_step(wl, [0], [0], slow, micro_batches=2, pause_cost=pause, emulation="profile")
    assert wall.compute_s[0] == pytest.approx(2 * (3 * 0.014 + 3 * 0.024))
    assert profile.compute_s[0] == pytest.approx(2 * (0.014 + 0.02 + 0.024 + 0.04))
    # without emulation the two are the same replay
    plain = [
        replay_step(wl, [0], [0], base, micro_batches=2, pause_cost=pause, emulation=e).step_s
        for e in ("wall", "profile")
    ]
    assert plain[0] == pytest.approx(plain[1])


def test_the_closed_form_prices_the_1f1b_window_over_slow_links() -> None:
    """Three stages of 5 + 10 ms over 50 ms links, 8 micro-batches. Stage 0 (depth 2) holds
    at most three micro-batches, and one loops through everything downstream in 5 + 50 + 5 +
    50 + 5 + 10 + 50 + 10 + 50 + 10 = 245 ms, so it can start one every 245 / 3 ms, not one
    every 15 ms as the compute alone would allow."""
    wl = chain_workload([0.005] * 3, bwd_s=[0.01] * 3, edge_bytes=[1000, 1000], grad_bytes=[1000, 1000])
    topology = make_topology(np.full((3, 3), 1e9), latency_s=0.05)
    est = estimate(wl, [0, 1, 2], [0, 1, 2], topology, micro_batches=8)
    assert est.bottleneck_s == pytest.approx(0.245 / 3, rel=0.02)
    replay = replay_step(wl, [0, 1, 2], [0, 1, 2], topology, micro_batches=8)
    assert est.step_s == pytest.approx(replay.step_s, rel=0.05)
    # GPipe holds every micro-batch: the window does not bind, and compute sets the period.
    gpipe = estimate(wl, [0, 1, 2], [0, 1, 2], topology, micro_batches=8, schedule="gpipe")
    assert gpipe.bottleneck_s == pytest.approx(0.015)
