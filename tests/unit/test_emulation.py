"""Emulated slower devices (:mod:`testbeds.emulation`, :mod:`testbeds.worker`): what is
stretched, by how much, and how a slowed worker's report reaches the planner.

Stretch lengths are checked through a recording ``stretch`` (what it was asked to add), not
by timing the whole run; one test checks that the sleep itself happens.
"""

from __future__ import annotations

import time

import pytest
import torch
from google.protobuf.json_format import MessageToDict

from fusion.coordinator.planning import Endpoint, machine_speeds
from fusion.errors import ConfigError
from fusion.profiling import DeviceProfile
from fusion.worker import resources_message
from testbeds.emulation import Slowdown, check_factor
from testbeds.worker import EmulatedDevice, emulated_profile, stage_seconds


class RecordingSlowdown(Slowdown):
    """A slowdown that records each stretch instead of sleeping (every backward piece its
    own unless ``min_piece_s`` says otherwise)."""

    def __init__(self, factor: float, min_piece_s: float = 0.0) -> None:
        super().__init__(factor, min_piece_s=min_piece_s)
        self.stretched: list[float] = []

    def stretch(self, seconds: float, reference_s: float | None = None) -> float:
        if self.by_profile:
            assert reference_s is not None
            seconds = reference_s
        self.stretched.append(seconds)
        return (self.factor - 1.0) * seconds


@pytest.mark.parametrize("bad", [0.5, 0.0, -2.0, float("nan"), float("inf"), True, "2"])
def test_a_slowdown_is_a_finite_number_of_at_least_one(bad: object) -> None:
    with pytest.raises(ConfigError, match="slowdown must be a finite number >= 1"):
        check_factor(bad)  # type: ignore[arg-type]


def test_stretch_sleeps_the_rest_of_a_slower_device() -> None:
    t0 = time.perf_counter()
    assert Slowdown(3.0).stretch(0.05) == pytest.approx(0.10)
    assert time.perf_counter() - t0 >= 0.10
    assert Slowdown(1.0).stretch(10.0) == 0.0  # no emulation: no sleep at all


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_attach_stretches_each_forward_and_the_backward_piece_by_piece() -> None:
    model, slow = _mlp(), RecordingSlowdown(2.5)
    slow.attach(model)
    for _ in range(3):  # three micro-batches: one forward each, and a backward piece per parameter
        model(torch.randn(5, 8)).sum().backward()
    # each backward: a piece per parameter, then the end of the pass (nothing left: ~0)
    assert len(slow.stretched) == 3 * (1 + 4 + 1) and all(s >= 0 for s in slow.stretched)
    assert sum(slow.stretched[1:5]) > 0  # the first backward's pieces
    with torch.no_grad():  # a forward without autograd is stretched too, and waits for no backward
        model(torch.randn(5, 8))
    assert len(slow.stretched) == 19


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward computes for ``seconds`` (a stand-in for a heavy layer)."""

    seconds = 0.0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        end = time.perf_counter() + _SlowBackward.seconds
        while time.perf_counter() < end:
            pass
        return grad


class _Layered(torch.nn.Module):
    """Two linear layers with a 5 ms backward between them (in backward order: the second
    layer's gradients, the slow part, the first layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_SlowBackward.apply(self.first(x)))


def test_short_backward_pieces_wait_for_a_longer_one_or_the_end_of_the_pass() -> None:
    """Each stretch is a sleep after which the next piece computes slower (the pause cost,
    multiplied by the factor): pieces under ``min_piece_s`` are stretched together."""
    _SlowBackward.seconds = 0.005
    model, slow = _Layered(), RecordingSlowdown(3.0, min_piece_s=0.002)
    slow.attach(model)
    model(torch.randn(5, 8)).sum().backward()
    forward, *backward = slow.stretched
    # The second layer's two gradients are under 2 ms: no stretch of their own. The first
    # layer's weight comes after the 5 ms: that piece holds both and is stretched; its bias
    # follows at once and waits for the end of the pass.
    assert len(backward) == 2
    assert backward[0] >= 0.005 and backward[1] < 0.002
    assert forward >= 0
    # the default is the same rule at MIN_PIECE_S
    from testbeds.emulation import MIN_PIECE_S

    assert Slowdown(2.0).min_piece_s == MIN_PIECE_S > 0


def test_attach_changes_no_number() -> None:
    x = torch.randn(5, 8)
    plain, slowed = _mlp(), _mlp()
    RecordingSlowdown(4.0).attach(slowed)
    plain(x).pow(2).mean().backward()
    slowed(x).pow(2).mean().backward()
    for a, b in zip(plain.parameters(), slowed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_factor_one_attaches_nothing() -> None:
    model, slow = _mlp(), RecordingSlowdown(1.0)
    slow.attach(model)
    model(torch.randn(2, 8)).sum().backward()
    assert slow.stretched == []
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_only_parameters_that_get_a_gradient_end_a_piece() -> None:
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
            return self.a(x) + (self.b(x) if use_b else 0)

    model, slow = TwoHeads(), RecordingSlowdown(2.0)
    slow.attach(model)
    model(torch.randn(3, 4), use_b=False).sum().backward()  # b gets no gradient: a's two pieces
    assert len(slow.stretched) == 1 + 2 + 1  # (and the end of the pass)
    model(torch.randn(3, 4)).sum().backward()
    assert len(slow.stretched) == 4 + 1 + 4 + 1


def _profile(flops: float, machine: str) -> DeviceProfile:
    return DeviceProfile(
        num_cores=2,
        memory_bytes=2**30,
        device="cpu",
        device_name="CPU",
        device_memory_bytes=2**30,
        matmul_flops=flops,
        machine=machine,
    )


def test_a_slowed_worker_reports_the_machine_speed_over_its_factor_as_its_own_device() -> None:
    measured = _profile(55e9, "box/cpu")
    message = resources_message(emulated_profile(measured, 3.0, 60e9))
    assert message.matmul_flops == pytest.approx(20e9)  # the launcher's machine speed, over the factor
    assert message.machine == "box/cpu" and message.device_name == "CPU, 3x slower"
    plain = resources_message(emulated_profile(measured, 1.0, 60e9))
    assert plain.matmul_flops == pytest.approx(60e9) and plain.device_name == "CPU"
    own = resources_message(emulated_profile(measured, 2.0, None))  # no launcher figure: its own measurement
    assert own.matmul_flops == pytest.approx(27.5e9)
    endpoint = Endpoint.from_registration(
        "b-1", "10.0.0.3:5000", MessageToDict(message, preserving_proto_field_name=True)
    )
    assert endpoint.machine == "box/cpu" and endpoint.device_name == "CPU, 3x slower"


def test_workers_on_one_machine_keep_their_emulated_ratios() -> None:
    # Processes on one CPU: the unslowed ones measured a share of it (noise) and take its best;
    # two emulate a device 3x slower (their own device name) and keep their speed.
    workers = [
        Endpoint("a-1", "x:1", matmul_flops=50e9, device_name="CPU", machine="box/cpu"),
        Endpoint("a-2", "x:2", matmul_flops=60e9, device_name="CPU", machine="box/cpu"),
        Endpoint("b-1", "x:3", matmul_flops=20e9, device_name="CPU, 3x slower", machine="box/cpu"),
        Endpoint("b-2", "x:4", matmul_flops=20e9, device_name="CPU, 3x slower", machine="box/cpu"),
        Endpoint("far", "y:1", matmul_flops=9e9, device_name="CPU", machine=None),  # alone: its own report
    ]
    assert machine_speeds(workers) == pytest.approx([60e9, 60e9, 20e9, 20e9, 9e9])


def test_a_testbed_emulates_the_slowdowns_or_with_speeds_the_flops_ratios() -> None:
    from scheduler.topology import Topology, WorkerSpec
    from testbeds.sim.topologies import emulated_slowdowns

    workers = [
        WorkerSpec(name="fast", cluster="a", flops=1.4e13),
        WorkerSpec(name="old", cluster="b", flops=4.4e12),
        WorkerSpec(name="hot", cluster="b", flops=1.4e13, slowdown=1.5),  # throttled
    ]
    topology = Topology.from_measurements(workers, [[0.0] * 3] * 3, [[1e9] * 3] * 3)
    assert emulated_slowdowns(topology) == {"hot": 1.5}
    assert emulated_slowdowns(topology, speeds=True) == {"old": pytest.approx(3.182), "hot": 1.5}


# ------------------------------------------------------------------ profile emulation
def test_profile_emulation_sleeps_the_reference_not_the_wall_time() -> None:
    slow = Slowdown(3.0, emulation="profile")
    t0 = time.perf_counter()
    assert slow.stretch(10.0, 0.02) == pytest.approx(
        0.04
    )  # (3 - 1) x the profiled 0.02 s, whatever the computation took
    assert 0.04 <= time.perf_counter() - t0 < 1.0
    with pytest.raises(ConfigError, match="profiled seconds"):
        slow.stretch(0.01)
    assert Slowdown(1.0, emulation="profile").stretch(0.01) == 0.0  # no emulation needs no reference
    with pytest.raises(ConfigError, match="unknown emulation 'cpu'"):
        Slowdown(2.0, emulation="cpu")


def test_profile_attach_cuts_the_profiled_backward_where_the_named_gradients_are_ready() -> None:
    model, slow = _mlp(), RecordingSlowdown(2.0, min_piece_s=0.0)
    slow.emulation = "profile"
    # the last layer's gradients are ready first; the backward takes 0.010 s in all
    slow.attach(
        model, forward_s=0.004, backward_s=0.010, ready_s={"2.weight": 0.003, "2.bias": 0.003, "0.weight": 0.009}
    )
    for _ in range(2):
        model(torch.randn(5, 8)).sum().backward()
    # per micro-batch: the forward, pieces up to 0.003 and 0.009 s, and the rest at the end of the pass
    assert slow.stretched == pytest.approx([0.004, 0.003, 0.006, 0.001] * 2)


def test_profile_attach_without_cuts_stretches_the_whole_backward_at_the_end() -> None:
    model, slow = _mlp(), RecordingSlowdown(2.0, min_piece_s=0.0)
    slow.emulation = "profile"
    slow.attach(model, forward_s=0.004, backward_s=0.010)
    model(torch.randn(5, 8)).sum().backward()
    assert slow.stretched == pytest.approx([0.004, 0.010])


def test_profile_attach_needs_the_profile_and_known_parameters() -> None:
    with pytest.raises(ConfigError, match="forward and backward seconds"):
        Slowdown(2.0, emulation="profile").attach(_mlp())
    with pytest.raises(ConfigError, match="no parameter 'fc.weight'"):
        Slowdown(2.0, emulation="profile").attach(_mlp(), forward_s=0.1, backward_s=0.1, ready_s={"fc.weight": 0.05})


def test_a_stage_sums_its_nodes_in_the_calibrated_profile() -> None:
    from fusion.wire import coordinator_pb2 as cpb

    profile = cpb.GetProfileResponse(
        nodes=[
            cpb.NodeProfile(name="a", forward_s=0.001, backward_s=0.002),
            cpb.NodeProfile(name="b", forward_s=0.003, backward_s=0.004),
            cpb.NodeProfile(name="c", forward_s=0.01, backward_s=0.02),
        ],
        compute_factor=2.0,
    )
    # "x": a node the profile has no cost for (input, output)
    assert stage_seconds(profile, ["a", "b", "x"]) == pytest.approx((0.008, 0.012))
    assert stage_seconds(profile, ["c"]) == pytest.approx((0.02, 0.04))
    profile.compute_factor = 0.0  # not calibrated: as profiled
    assert stage_seconds(profile, ["c"]) == pytest.approx((0.01, 0.02))


def test_the_emulated_device_hook_stretches_each_computation_by_its_stage_profile() -> None:
    from executor.hooks import BACKWARD, FORWARD, StageInfo

    stage = StageInfo(job_id="j", stage_idx=1, nodes=("c",), worker_name="w")
    device = EmulatedDevice(3.0, emulation="profile", seconds=lambda s: (0.01, 0.02))
    device.stage_loaded(stage)
    for kind, want_s in ((FORWARD, 0.02), (BACKWARD, 0.04)):  # (3 - 1) x the profiled seconds
        t0 = time.perf_counter()
        with device.compute(stage, kind, 0, 0):
            pass
        assert want_s <= time.perf_counter() - t0 < want_s + 0.5
    for bad in ((float("nan"), 0.01), (0.01, -1.0)):
        with pytest.raises(ConfigError, match="profiled seconds must be finite"):
            EmulatedDevice(3.0, emulation="profile", seconds=lambda s, bad=bad: bad).stage_loaded(stage)
    with pytest.raises(ConfigError, match="--emulation profile.*no profiled seconds"):
        EmulatedDevice(3.0, emulation="profile", seconds=lambda s: (0.0, 0.0)).stage_loaded(stage)


def test_the_benchmark_reads_the_served_profile_as_the_coordinator_caches_it() -> None:
    from fusion.wire import coordinator_pb2 as cpb
    from testbeds.job_profile import profile_document

    served = cpb.GetProfileResponse(
        nodes=[
            cpb.NodeProfile(name="a", forward_s=0.001, backward_s=0.002, saved_bytes=64.0),
            cpb.NodeProfile(name="__graph__", forward_s=0.001, backward_s=0.002),
        ],
        compute_factor=1.5,
        matmul_flops=1e10,
        optimizer_s_per_byte=1e-10,
        device_name="CPU",
        overhead_step_s=0.0,  # a calibration may find no fixed cost: 0 is a value
        overhead_micro_batch_s=0.001,
        calibrated=True,
    )
    doc = profile_document(served)
    assert doc["nodes"] == {
        "a": {"fwd_time_s": 0.001, "bwd_time_s": 0.002, "saved_bytes": 64.0},
        "__graph__": {"fwd_time_s": 0.001, "bwd_time_s": 0.002},
    }
    assert (doc["compute_factor"], doc["overhead_step_s"], doc["overhead_micro_batch_s"]) == (1.5, 0.0, 0.001)
    served.calibrated = False
    assert profile_document(served)["overhead_step_s"] is None
