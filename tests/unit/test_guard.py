"""InputGuard: what a stage accepts from its peers, and the tests' injected faults.

The guard must catch NaN/Inf at once, catch absurd norm jumps only after its warm-up,
never learn from a tensor it rejected, and leave alone gradients that start near zero and
grow by orders of magnitude as training finds a path (the RMS floor).
"""

from __future__ import annotations

import math

import pytest
import torch

from executor.guard import (
    MAX_NORM_RATIO,
    RMS_FLOOR,
    WARMUP_OBSERVATIONS,
    InputGuard,
)
from fusion.errors import ConfigError, PoisonedInputError
from fusion.wire import tensor_pb2 as pb
from tests.support.fault import SCALE, Fault

ACT = pb.TRANSFER_KIND_ACTIVATION
GRAD = pb.TRANSFER_KIND_GRADIENT


def scaled(norm: float, numel: int = 64) -> torch.Tensor:
    """A tensor of ``numel`` equal values whose L2 norm is ``norm``."""
    return torch.full((numel,), norm / math.sqrt(numel))


def warm(guard: InputGuard, kind: int, src: int, name: str, norm: float, numel: int = 64) -> None:
    for _ in range(WARMUP_OBSERVATIONS):
        guard.check(kind, src, {name: scaled(norm, numel)})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_rejected_from_the_first_tensor(bad: float) -> None:
    guard = InputGuard()
    t = torch.ones(4, 4)
    t[2, 3] = bad
    with pytest.raises(PoisonedInputError) as info:
        guard.check(GRAD, 3, {"h": t})
    assert info.value.sender_stage == 3
    assert "1 NaN/Inf value(s) of 16" in info.value.reason
    assert "gradient 'h'" in info.value.reason
    assert guard.num_rejected == 1


def test_non_float_and_empty_tensors_are_not_checked() -> None:
    guard = InputGuard()
    guard.check(ACT, 0, {"ids": torch.tensor([1, 2, 3]), "empty": torch.empty(0), "mask": torch.tensor([True])})
    assert guard.num_rejected == 0


def test_norm_bound_only_after_warm_up() -> None:
    guard = InputGuard()
    # During warm-up any finite norm is accepted, even wild swings.
    for norm in (10.0, 1e6, 10.0)[:WARMUP_OBSERVATIONS]:
        guard.check(ACT, 0, {"x": scaled(norm)})
    assert guard.num_rejected == 0


def test_ratio_rule_rejects_a_thousandfold_jump_and_accepts_ordinary_growth() -> None:
    guard = InputGuard()
    warm(guard, ACT, 1, "x", 100.0)  # RMS 12.5, well above the floor
    guard.check(ACT, 1, {"x": scaled(100.0 * 50)})  # 50x: loss spikes happen
    with pytest.raises(PoisonedInputError) as info:
        guard.check(ACT, 1, {"x": scaled(100.0 * MAX_NORM_RATIO * 10)})
    assert info.value.sender_stage == 1
    assert "over 1000x" in info.value.reason
    assert guard.num_rejected == 1


def test_links_are_tracked_separately() -> None:
    guard = InputGuard()
    warm(guard, ACT, 1, "x", 100.0)
    # A different sender, kind or value name has statistics of its own (still warming up).
    guard.check(ACT, 2, {"x": scaled(1e9)})
    guard.check(GRAD, 1, {"x": scaled(1e9)})
    guard.check(ACT, 1, {"y": scaled(1e9)})
    assert guard.num_rejected == 0


def test_rms_floor_lets_tiny_gradients_grow_ten_thousandfold() -> None:
    guard = InputGuard()
    numel = 256
    tiny = 1e-6 * math.sqrt(numel)  # RMS 1e-6
    warm(guard, GRAD, 2, "g", tiny, numel)
    grown = tiny * 1e4  # RMS 1e-2: far over the ratio, far under the floor
    assert grown / math.sqrt(numel) < RMS_FLOOR
    guard.check(GRAD, 2, {"g": scaled(grown, numel)})
    assert guard.num_rejected == 0


def test_huge_jump_above_the_rms_floor_is_rejected() -> None:
    guard = InputGuard()
    numel = 256
    tiny = 1e-6 * math.sqrt(numel)
    warm(guard, GRAD, 2, "g", tiny, numel)
    with pytest.raises(PoisonedInputError):
        guard.check(GRAD, 2, {"g": scaled(1e3 * math.sqrt(numel), numel)})  # RMS 1e3


def test_rejected_tensors_do_not_move_the_statistics() -> None:
    guard = InputGuard()
    warm(guard, ACT, 0, "x", 100.0)
    huge = scaled(100.0 * MAX_NORM_RATIO * 10)
    # If rejected tensors were learned from, repeating the attack would eventually pass.
    for _ in range(50):
        with pytest.raises(PoisonedInputError):
            guard.check(ACT, 0, {"x": huge})
    assert guard.num_rejected == 50
    # A transfer with one bad value is rejected as a whole: its good value is not learned either.
    for _ in range(50):
        with pytest.raises(PoisonedInputError):
            guard.check(ACT, 0, {"x": huge, "y": scaled(5.0)})
    guard.check(ACT, 0, {"y": scaled(1e9)})  # "y" is still in warm-up: never observed


def test_guard_parameters_are_validated() -> None:
    with pytest.raises(ValueError):
        InputGuard(max_norm_ratio=1.0)
    with pytest.raises(ValueError):
        InputGuard(warmup=0)


def test_fault_parse() -> None:
    assert Fault.parse(None) is None
    assert Fault.parse("") is None
    assert Fault.parse("nan-gradients") == Fault(kind="nan-gradients", from_step=0)
    assert Fault.parse("nan-activations@12") == Fault(kind="nan-activations", from_step=12)
    assert Fault.parse("scaled-gradients@3") == Fault(kind="scaled-gradients", from_step=3)
    for bad in ("nan", "nan-gradients@", "nan-gradients@x", "nan-gradients@-1", "inf-gradients@3"):
        with pytest.raises(ConfigError):
            Fault.parse(bad)


def test_fault_corrupts_only_its_kind_from_its_step() -> None:
    fault = Fault(kind="nan-gradients", from_step=5)
    tensors = {"g": torch.ones(3), "ids": torch.tensor([1, 2])}
    assert fault.corrupt("gradients", 4, tensors) is tensors
    assert fault.corrupt("activations", 9, tensors) is tensors
    out = fault.corrupt("gradients", 5, tensors)
    assert torch.isnan(out["g"]).all()
    assert torch.equal(out["ids"], tensors["ids"])
    with pytest.raises(PoisonedInputError):
        InputGuard().check(GRAD, 1, out)


def test_a_scaled_fault_is_caught_by_the_norm_bound_after_the_warm_up() -> None:
    fault = Fault(kind="scaled-activations", from_step=WARMUP_OBSERVATIONS)
    guard = InputGuard()
    for step in range(WARMUP_OBSERVATIONS):
        guard.check(ACT, 0, fault.corrupt("activations", step, {"x": scaled(100.0)}))
    out = fault.corrupt("activations", WARMUP_OBSERVATIONS, {"x": scaled(100.0)})
    assert float(torch.linalg.vector_norm(out["x"])) == pytest.approx(100.0 * SCALE)
    with pytest.raises(PoisonedInputError, match="norm"):
        guard.check(ACT, 0, out)
